"""xgrammar against llguidance on the CPU: what structured output costs with each grammar engine
at a 32k and a 202k byte-level vocabulary (docs/engine.md, "Structured output").

Per engine and vocabulary: building its tokenizer view (once per process), compiling each of a
few JSON schemas (the cache off: every compile is cold), and the per-token mask along a valid
answer (the matcher takes the answer's tokens one at a time; each step fills the next token's
bitmask, int32 [W], W = ceil(V / 32)). The vocabulary is generated: the 256 byte-level symbols
and random merges of existing tokens (a valid byte-level BPE, mostly letters, digits, spaces
and JSON punctuation), so no tokenizer is downloaded.

    python benchmarks/grammar_engines.py                  # both vocabularies, ~1 minute
    python benchmarks/grammar_engines.py --vocabs 32000   # one
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 9999},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    "role": {"enum": ["admin", "user", "guest"]},
                },
                "required": ["id", "role"],
            },
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["user", "score"],
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}, "ok": {"type": "boolean"}},
            "required": ["x", "y", "ok"],
        },
        "minItems": 1,
        "maxItems": 8,
    },
}
ANSWERS = {
    "flat": '{"name": "Ada Lovelace", "age": 36}',
    "nested": '{"user": {"id": 42, "tags": ["math", "poetry"], "role": "admin"}, "score": 0.75}',
    "array_of_objects": '[{"x": 1.5, "y": -2, "ok": true}, {"x": 0, "y": 3.25, "ok": false}]',
}
SPECIALS = ["<pad>", "<s>", "</s>"]


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map: the 256 symbols of a byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def tokenizer_json(vocab_size: int, seed: int = 0) -> str:
    """A byte-level BPE tokenizer.json of ``vocab_size`` entries: 3 specials, the 256 byte
    symbols, and merges of random pairs of earlier tokens (each a valid merge)."""
    rng = random.Random(seed)
    sym = byte_symbols()
    common = [sym[b] for b in b'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 ,.:"{}[]-_\n']
    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}
    for s in sym:
        vocab[s] = len(vocab)
    tokens = list(common)
    merges: list[list[str]] = []
    while len(vocab) < vocab_size:
        a, b = rng.choice(tokens), rng.choice(tokens if rng.random() < 0.7 else common)
        t = a + b
        if len(t) > 16 or t in vocab:
            continue
        vocab[t] = len(vocab)
        merges.append([a, b])
        tokens.append(t)
    spec = {
        "version": "1.0",
        "added_tokens": [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
            for i, s in enumerate(SPECIALS)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }  # fmt: skip
    return json.dumps(spec)


def bench_xgrammar(tok_json: str, vocab_size: int, ids: dict[str, list[int]], threads: int) -> dict:
    import xgrammar as xgr

    spec = json.loads(tok_json)
    vocab = [""] * vocab_size
    for piece, i in spec["model"]["vocab"].items():
        vocab[i] = piece if i >= len(SPECIALS) else ""
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[2])
    compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
    out: dict = {"tokenizer_s": time.perf_counter() - t0, "compile_s": {}, "mask_us_per_token": {}}
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=True)
        out["compile_s"][name] = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        spent = 0.0
        for t in ids[name]:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            spent += time.perf_counter() - t0
            bit = (int(mask[0, t // 32]) >> (t % 32)) & 1
            assert bit and matcher.accept_token(t), f"xgrammar refuses token {t} of {name}"
        out["mask_us_per_token"][name] = 1e6 * spent / len(ids[name])
    return out


def bench_llguidance(tok_json: str, vocab_size: int, ids: dict[str, list[int]]) -> dict:
    import llguidance
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(tok_json, n_vocab=vocab_size, eos_token=2)
    out: dict = {"tokenizer_s": time.perf_counter() - t0, "compile_s": {}, "mask_us_per_token": {}}
    for name, schema in SCHEMAS.items():
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults={"whitespace_flexible": True}
        )
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(tok, grammar)
        out["compile_s"][name] = time.perf_counter() - t0  # llguidance builds its parser lazily
        assert not matcher.is_error(), matcher.get_error()
        mask = lt.allocate_token_bitmask(1, vocab_size)
        spent = 0.0
        for t in ids[name]:
            t0 = time.perf_counter()
            lt.fill_next_token_bitmask(matcher, mask, 0)
            spent += time.perf_counter() - t0
            bit = (int(mask[0, t // 32]) >> (t % 32)) & 1
            assert bit and matcher.consume_token(t), f"llguidance refuses token {t} of {name}: {matcher.get_error()}"
        out["mask_us_per_token"][name] = 1e6 * spent / len(ids[name])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocabs", default="32000,202048", help="vocabulary sizes, comma-separated")
    p.add_argument("--threads", type=int, default=1, help="xgrammar's compile threads")
    p.add_argument("--json", default="benchmarks/results/grammar-engines-cpu.json")
    args = p.parse_args(argv)
    from importlib.metadata import version

    from tokenizers import Tokenizer

    rows, results = [], []
    for v in (int(x) for x in args.vocabs.split(",")):
        t0 = time.perf_counter()
        tj = tokenizer_json(v)
        gen_s = time.perf_counter() - t0
        tok = Tokenizer.from_str(tj)
        ids = {name: tok.encode(a).ids for name, a in ANSWERS.items()}
        r = {
            "vocab_size": v,
            "generate_tokenizer_s": gen_s,
            "answer_tokens": {k: len(x) for k, x in ids.items()},
            "xgrammar": bench_xgrammar(tj, v, ids, args.threads),
            "llguidance": bench_llguidance(tj, v, ids),
        }
        results.append(r)
        for eng in ("xgrammar", "llguidance"):
            e = r[eng]
            for name in SCHEMAS:
                rows.append((v, eng, e["tokenizer_s"], name, e["compile_s"][name], e["mask_us_per_token"][name]))
    print(f"{'vocab':>7} {'engine':<11} {'tokenizer s':>11} {'schema':<17} {'compile ms':>10} {'mask us/token':>13}")
    for v, eng, ts, name, cs, mu in rows:
        print(f"{v:>7} {eng:<11} {ts:>11.2f} {name:<17} {1e3 * cs:>10.1f} {mu:>13.1f}")
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    doc = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "commit": commit,
        "device": f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "versions": {"xgrammar": version("xgrammar"), "llguidance": version("llguidance")},
        "results": results,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
