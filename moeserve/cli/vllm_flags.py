"""vLLM's ``serve`` flags that set nothing in moeserve, parsed so that a vLLM command line starts:
each given flag prints one start-up line saying what moeserve does instead, and a value
moeserve cannot take, or a flag of something it does not serve, exits 2 with the reason
(docs/http-api.md, "Models, ports and flags")."""

from __future__ import annotations

import argparse

from moeserve.cli import UsageError

# vLLM's serve flags that set nothing here: (flags, nargs: 0 a switch / 1 a value, the values
# taken (None: any), what moeserve does instead). A value outside the taken ones, or a flag with
# None as its "what", is refused with the reason.
VLLM_NOOP_FLAGS: tuple[tuple[tuple[str, ...], int, tuple | None, str | None], ...] = (
    (("--kv-cache-dtype",), 1, ("auto",), "the KV cache is kept in the model's dtype"),
    (("--tokenizer-mode",), 1, ("auto", "hf"), "the model folder's tokenizer.json is the tokenizer"),
    (("--model-impl",), 1, ("auto",), "moeserve runs its own model code"),
    (("--config-format", "--load-config-format"), 1, ("auto", "hf"), "config.json is read as Hugging Face writes it"),
    (
        ("--disable-log-requests", "--enable-log-requests", "--disable-log-stats"),
        0,
        None,
        "moeserve logs no request or interval statistics",
    ),
    (("--swap-space",), 1, None, "a preempted sequence is recomputed, never swapped to the CPU"),
    (("--enable-chunked-prefill",), 0, None, "prefill is always chunked by --max-num-batched-tokens"),
    (("--max-seq-len-to-capture",), 1, None, "decode graphs are captured per batch bucket"),
    (("--disable-custom-all-reduce",), 0, None, "moeserve runs no all-reduce"),
    (("--distributed-executor-backend",), 1, ("mp",), "ranks are processes of this host"),
    (("--worker-multiproc-method",), 1, ("spawn",), "ranks are always spawned"),
    (("--max-parallel-loading-workers",), 1, None, "each rank reads its own share of the checkpoint"),
    (("--disable-fastapi-docs",), 0, None, "the HTTP API serves no docs pages"),
    (("--uvicorn-log-level",), 1, None, "the front end logs warnings and errors"),
    (("--response-role",), 1, ("assistant",), "chat answers have the role assistant"),
    (("--compilation-config", "-O"), 1, None, "decode steps replay CUDA graphs (--enforce-eager turns them off)"),
    (("--data-parallel-backend",), 1, ("mp",), "ranks are processes of this host"),
    (("--tool-parser-plugin",), 1, None, None),
    (("--speculative-config", "--enable-lora", "--lora-modules", "--enable-sleep-mode"), 1, None, None),
    (("--limit-mm-per-prompt", "--mm-processor-kwargs", "--hf-overrides", "--otlp-traces-endpoint"), 1, None, None),
    (("--headless", "--data-parallel-address", "--data-parallel-rpc-port", "--reasoning-parser"), 1, None, None),
)
NOT_HONOURED = "moeserve does not serve this (tool parser plugins, speculative decoding, LoRA, multimodal inputs, multi-node data parallelism and reasoning parsers are not available)"


def add_vllm_noop_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's serve flags of :data:`VLLM_NOOP_FLAGS`, parsed so that a vLLM command line starts
    (``check_vllm_noops`` says what each became, or refuses it)."""
    g = p.add_argument_group("vLLM flags that set nothing here (each logs what moeserve does instead)")
    for names, nargs, taken, what in VLLM_NOOP_FLAGS:
        for name in names:
            dest = "vllm_noop_" + name.lstrip("-").replace("-", "_")
            only = f" ({', '.join(taken)} only)" if taken else ""
            help_ = f"accepted{only}: {what}" if what else "refused: " + NOT_HONOURED
            if nargs == 0 and what:
                g.add_argument(name, dest=dest, action="store_true", default=None, help=help_)
            elif what is None:  # refused, given with a value or as a switch
                g.add_argument(name, dest=dest, default=None, metavar="VALUE", nargs="?", const="", help=help_)
            else:
                g.add_argument(name, dest=dest, default=None, metavar="VALUE", help=help_)


def check_vllm_noops(args) -> list[str]:
    """What each vLLM flag of :data:`VLLM_NOOP_FLAGS` given became (lines for the start-up log);
    UsageError for a value moeserve cannot take or a flag it does not serve."""
    notes = []
    for names, _, taken, what in VLLM_NOOP_FLAGS:
        for name in names:
            v = getattr(args, "vllm_noop_" + name.lstrip("-").replace("-", "_"), None)
            if v is None or v is False:
                continue
            if what is None:
                raise UsageError(f"{name}: {NOT_HONOURED}")
            if taken is not None and str(v) not in taken:
                raise UsageError(f"{name} {v}: {what}; moeserve takes {' or '.join(taken)}")
            notes.append(f"{name}{'' if v is True else f' {v}'}: accepted, {what}")
    return notes
