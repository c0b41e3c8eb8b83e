"""moeserve.ops.hub: a model named by a folder or a Hugging Face id, resolved through huggingface_hub's
cache. Tests build the cache's layout on disk (blobs, refs, snapshots of symlinks) and resolve
offline; nothing is downloaded, and HF_ENDPOINT points at a closed local port so that an
attempt to reach the Hub could not succeed."""

import hashlib
import os
from pathlib import Path

import pytest

from moeserve.ops import hub

pytestmark = pytest.mark.timeout(60)


def make_hub_cache(cache: Path, repo_id: str, src: Path, refs=("main",), commit: str | None = None) -> Path:
    """Lay ``src``'s files out as huggingface_hub's cache does for model ``repo_id``:
    blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>, refs/<ref> = commit.
    Returns the snapshot folder."""
    repo = Path(cache) / ("models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}{sorted(os.listdir(src))}".encode()).hexdigest()
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if not f.is_file():
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
            blob.chmod(0o644)
        link = snap / f.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, snap))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from moeserve.models import init_model

    return init_model(tmp_path_factory.mktemp("tiny"), "llama4", seed=3)


@pytest.fixture
def offline_env(monkeypatch, tmp_path):
    home = tmp_path / "hf"
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    return home / "hub"


def test_a_folder_is_taken_as_it_is(tiny):
    assert hub.resolve(str(tiny)) == Path(tiny)


def test_an_id_resolves_offline_to_its_snapshot_in_hf_home(tiny, offline_env):
    snap = make_hub_cache(offline_env, "tiny-org/tiny-llama4", tiny)
    got = hub.resolve("tiny-org/tiny-llama4")
    assert got == snap and (got / "config.json").is_file() and (got / "model.safetensors").is_file()
    assert hub.cache_dir() == offline_env and hub.offline()


def test_revision_selects_a_branch_tag_or_commit(tiny, offline_env, tmp_path):
    main = make_hub_cache(offline_env, "org/m", tiny)
    other_src = tmp_path / "other"
    other_src.mkdir()
    for f in tiny.iterdir():
        (other_src / f.name).write_bytes(f.read_bytes())
    (other_src / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    v2 = make_hub_cache(offline_env, "org/m", other_src, refs=("v2",), commit="b" * 40)
    assert hub.resolve("org/m") == main
    assert hub.resolve("org/m", revision="v2") == v2
    assert hub.resolve("org/m", revision="b" * 40) == v2
    with pytest.raises(hub.ModelNotFound, match="revision nope"):
        hub.resolve("org/m", revision="nope")


def test_download_dir_is_the_cache_read(tiny, offline_env, tmp_path):
    cache = tmp_path / "elsewhere"
    snap = make_hub_cache(cache, "org/m", tiny)
    with pytest.raises(hub.ModelNotFound):
        hub.resolve("org/m")  # not in HF_HOME's cache
    assert hub.resolve("org/m", download_dir=cache) == snap


def test_hf_hub_cache_wins_over_hf_home(tiny, offline_env, tmp_path, monkeypatch):
    cache = tmp_path / "hubcache"
    snap = make_hub_cache(cache, "org/m", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert hub.resolve("org/m") == snap


@pytest.mark.parametrize(
    "name,message",
    [
        ("org/not-cached", "is not in the Hugging Face cache"),
        ("/no/such/folder", "no such folder"),
        ("./relative/missing", "no such folder"),
        ("a/b/c", "no such folder"),
        ("bad name!", "no such folder"),
    ],
)
def test_what_cannot_be_found_says_what_and_where(offline_env, name, message):
    with pytest.raises(hub.ModelNotFound) as e:
        hub.resolve(name)
    assert message in str(e.value)
    if "cache" in message:
        assert str(offline_env) in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)


def test_a_snapshot_without_a_config_is_refused(tmp_path, offline_env):
    src = tmp_path / "src"
    src.mkdir()
    (src / "tokenizer.json").write_text("{}")
    make_hub_cache(offline_env, "org/tok-only", src)
    with pytest.raises(hub.ModelNotFound, match="has no config.json"):
        hub.resolve("org/tok-only")
    assert (hub.resolve_tokenizer("org/tok-only") / "tokenizer.json").is_file()


def test_a_file_is_not_a_model_folder(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(hub.ModelNotFound, match="not a folder"):
        hub.resolve(str(f))


def test_without_offline_an_unreachable_hub_falls_back_to_the_cache(tiny, offline_env, monkeypatch):
    """HF_HUB_OFFLINE unset: the Hub (a closed local port here) cannot be reached, so the
    cached snapshot of the revision is used."""
    from huggingface_hub import constants

    snap = make_hub_cache(offline_env, "org/m", tiny)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # read when the call is made
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert not hub.offline()
    assert hub.resolve("org/m", offline_only=False) == snap
