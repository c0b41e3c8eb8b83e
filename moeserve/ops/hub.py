"""A model named by a folder or by a Hugging Face id, resolved to a folder on this machine.

``resolve("meta-llama/Llama-4-Scout-17B-16E-Instruct")`` returns the snapshot folder of that
repository in the Hugging Face cache, through ``huggingface_hub.snapshot_download`` (only the
files moeserve reads: configs, safetensors, tokenizer files, chat templates):

- the cache is ``download_dir`` (vLLM's ``--download-dir``) or, as huggingface_hub has it,
  ``$HF_HUB_CACHE``, ``$HF_HOME/hub``, ``$XDG_CACHE_HOME/huggingface/hub`` or
  ``~/.cache/huggingface/hub``; the variables are read at each call;
- ``$HF_HUB_OFFLINE=1`` (or ``offline=True``) resolves from the cache alone: nothing is
  downloaded and no connection is made; otherwise a missing snapshot is downloaded (and when the
  Hub cannot be reached, the cached snapshot of ``revision`` is used);
- ``revision``: a branch, tag or commit (default ``main``).

Every failure is a :class:`ModelNotFound` whose message says what was looked for, where, and
what to do. A folder that exists is returned as it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]
TOKENIZER_FILES = [
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template*",
    "*.jinja",
    "config.json",
    "generation_config.json",
    "merges.txt",
    "vocab.*",
    "*.tiktoken",
]
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]{0,95}/)?[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")
_TRUE = {"1", "on", "yes", "true"}


class ModelNotFound(Exception):
    """A model or tokenizer that is neither a folder nor a snapshot that could be had."""


def offline() -> bool:
    """Whether $HF_HUB_OFFLINE (or $TRANSFORMERS_OFFLINE) forbids reaching the Hub."""
    return any(os.environ.get(v, "").strip().lower() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """The Hugging Face hub cache in force (read from the environment now)."""
    if download_dir:
        return Path(download_dir).expanduser()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def is_repo_id(name: str) -> bool:
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def resolve(
    name: str,
    revision: str | None = None,
    download_dir: str | os.PathLike | None = None,
    *,
    what: str = "model",
    files: list[str] | None = None,
    offline_only: bool | None = None,
    need: str | None = "config.json",
) -> Path:
    """The folder of ``name`` (a folder, or a Hugging Face id looked up in the cache or
    downloaded); ``need``: a file the folder must hold (None: any). Raises ModelNotFound."""
    path = Path(name).expanduser()
    if path.is_dir():
        return _check(path, name, what, need)
    if path.exists():
        raise ModelNotFound(f"{what} {name}: not a folder")
    if name.startswith(("/", "./", "../", "~")) or not is_repo_id(name):
        raise ModelNotFound(f"{what} {name}: no such folder (and not a Hugging Face model id such as 'org/name')")
    local = offline() if offline_only is None else offline_only
    cache = cache_dir(download_dir)
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:  # pragma: no cover (a dependency)
        raise ModelNotFound(
            f"{what} {name}: no such folder, and huggingface_hub is not installed to look it "
            "up in the Hugging Face cache (pip install huggingface_hub)"
        ) from None
    rev = revision or "main"
    try:
        folder = snapshot_download(
            name, revision=revision, cache_dir=str(cache), local_files_only=local, allow_patterns=files or MODEL_FILES
        )
    except LocalEntryNotFoundError:
        why = (
            "$HF_HUB_OFFLINE is set, so nothing is downloaded" if local else "the Hugging Face Hub could not be reached"
        )
        raise ModelNotFound(
            f"{what} {name} (revision {rev}) is not in the Hugging Face cache {cache} and {why}: download it "
            f"where the Hub can be reached (hf download {name} --cache-dir ...), point HF_HOME or --download-dir "
            f"at the cache holding it, or pass a folder"
        ) from None
    except GatedRepoError:
        raise ModelNotFound(
            f"{what} {name} is gated on the Hugging Face Hub: accept its license there and log "
            f"in (hf auth login or $HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"{what} {name}: no such repository on the Hugging Face Hub (or it is private: "
            f"log in with hf auth login or $HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{what} {name}: the repository has no revision {rev}") from None
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFound(f"{what} {name}: could not be had from the Hugging Face Hub: {e}") from None
    return _check(Path(folder), name, what, need)


def _check(folder: Path, name: str, what: str, need: str | None) -> Path:
    if need and not (folder / need).is_file():
        raise ModelNotFound(f"{what} {name}: {folder} has no {need}")
    return folder


def resolve_tokenizer(name: str, revision: str | None = None, download_dir=None, **kw) -> Path:
    """The folder of a tokenizer (``--tokenizer``): only its tokenizer files are fetched."""
    return resolve(name, revision, download_dir, what="tokenizer", files=TOKENIZER_FILES, need=None, **kw)


__all__ = ["ModelNotFound", "resolve", "resolve_tokenizer", "cache_dir", "offline", "is_repo_id"]
