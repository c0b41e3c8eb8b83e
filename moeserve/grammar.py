"""Structured output's grammars (xgrammar): what a request may constrain its tokens to, the
checks every grammar passes at the front end, and the vocabulary and compiler a router
compiles them with (docs/engine.md, "Structured output").

Dimension letters: C constrained rows of a step, V vocabulary, W = ceil(V / 32) mask words.

A :class:`GrammarSpec` is what travels: a kind and a text (``json_schema``: the schema as JSON
text; ``json_object``: any JSON object; ``regex``; ``ebnf``: xgrammar's EBNF with a ``root``
rule, which guided choice is written in). The front end checks it (:func:`check`, off the
event loop): the text's size, a JSON schema's depth, keywords and counts, the repetition
bounds of patterns, then xgrammar's own conversion to a grammar (no vocabulary needed), whose
size is bounded too; every refusal is a :class:`GrammarError` (HTTP 400) that names the
problem. The routers compile what passed with the model's vocabulary (:class:`Compiler`) in a
thread of their own, so the cost of a compile (milliseconds to a second at a 202k vocabulary)
never lands on a step; a compile has a deadline too.

xgrammar is imported on first use: a server without it serves every request but these, which
are refused naming the package (:func:`missing`).
"""

from __future__ import annotations

import json
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "ebnf")
MAX_GRAMMAR_CHARS = 64 << 10  # a schema, regex or grammar text
MAX_SCHEMA_DEPTH = 32  # nested subschemas (xgrammar's conversion grows fast past this)
MAX_COUNT = 10_000  # minLength, maxItems, ... (the output is bounded by max_tokens anyway)
MAX_PATTERN_CHARS = 4096
MAX_REPEAT = 256  # the bounds of a {m,n} repetition in a pattern or regex
MAX_EBNF_CHARS = 1 << 20  # the converted grammar, as xgrammar prints it
CHECK_TIMEOUT_S = 5.0  # the front end's conversion of one grammar
COMPILE_TIMEOUT_S = 30.0  # a router's compile of one grammar with the vocabulary
MAX_WHITESPACE = 16  # consecutive whitespace characters a JSON grammar allows between tokens

# JSON schema keywords xgrammar enforces (each checked against a matcher: moeserve's tests);
# oneOf is enforced as anyOf. Annotations are accepted and ignored.
SCHEMA_KEYWORDS = frozenset(
    {
        "type",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "$ref",
        "$defs",
        "definitions",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "unevaluatedItems",
        "contains",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    }
)
ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
        "deprecated",
        "readOnly",
        "writeOnly",
        "contentMediaType",
        "contentEncoding",
    }
)
FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "ipv4",
        "ipv6",
        "hostname",
        "json-pointer",
        "relative-json-pointer",
    }
)
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_NUMBERS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_ONE = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "unevaluatedItems", "contains")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarError(ValueError):
    """A grammar this server refuses (HTTP 400, as every ValueError of a request's values): the
    message names the problem and what is allowed."""


@dataclass(frozen=True)
class GrammarSpec:
    """One request's constraint: ``kind`` (one of :data:`KINDS`) and its ``text``;
    ``any_whitespace``: JSON grammars allow whitespace between tokens (up to
    :data:`MAX_WHITESPACE` characters at a time), else none (vLLM's ``disable_any_whitespace``)."""

    kind: str
    text: str = ""
    any_whitespace: bool = True

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"a grammar's text may have at most {MAX_GRAMMAR_CHARS} characters")

    @property
    def key(self) -> tuple[str, str, bool]:
        """What two requests share a compiled grammar by."""
        return self.kind, self.text, self.any_whitespace


def choice_grammar(choices: list[str]) -> str:
    """Guided choice as xgrammar EBNF: exactly one of the strings."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=True) for c in choices)


# -- xgrammar, imported on first use ----------------------------------------------------------

_lock = threading.Lock()
_xgr: Any = None
_missing: str | None = None


def missing() -> str | None:
    """Why this process cannot serve grammars (xgrammar is not installed), or None."""
    _load()
    return _missing


def _load():
    global _xgr, _missing
    with _lock:
        if _xgr is None and _missing is None:
            try:
                import xgrammar

                _xgr = xgrammar
            except ImportError as e:
                _missing = (
                    f"structured output needs the xgrammar package, which this server cannot import ({e}): "
                    f"pip install 'xgrammar>=0.2.9,<0.3'"
                )
    return _xgr


def _xgrammar():
    xgr = _load()
    if xgr is None:
        raise GrammarError(_missing or "xgrammar is not installed")
    return xgr


def preload() -> None:
    """Import xgrammar now (seconds: it imports transformers), e.g. in a thread at start, so that
    the first structured request does not wait for it."""
    _load()


def _message(e: BaseException) -> str:
    """xgrammar's error without its C++ source location."""
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return _XGR_PREFIX.sub("", lines[0]) if lines else type(e).__name__


# -- the front end's checks -------------------------------------------------------------------


def check_schema(schema, path: str = "json_schema", depth: int = 0) -> None:
    """The keywords, depth and counts of a JSON schema; GrammarError naming the first problem."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{path} must be a JSON schema (an object or a boolean), got {type(schema).__name__}")
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{path}: the schema nests deeper than {MAX_SCHEMA_DEPTH} subschemas")
    for key, value in schema.items():
        where = f"{path}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SCHEMA_KEYWORDS:
            raise GrammarError(
                f"{where}: the JSON schema keyword {key!r} is not supported by structured output "
                f"(supported: {', '.join(sorted(SCHEMA_KEYWORDS))})"
            )
        if key == "type":
            types = value if isinstance(value, list) else [value]
            if not types or any(t not in TYPES for t in types):
                raise GrammarError(f"{where} must be one of {', '.join(sorted(TYPES))} or a list of them")
        elif key in _COUNTS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
                raise GrammarError(f"{where} must be an integer in 0..{MAX_COUNT}, got {json.dumps(value)[:40]}")
        elif key in _NUMBERS:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GrammarError(f"{where} must be a finite number")
            if key == "multipleOf" and value <= 0:
                raise GrammarError(f"{where} must be > 0")
        elif key == "format":
            if value not in FORMATS:
                raise GrammarError(
                    f"{where}: the format {value!r} is not supported (supported: {', '.join(sorted(FORMATS))})"
                )
        elif key == "pattern":
            if not isinstance(value, str):
                raise GrammarError(f"{where} must be a string")
            check_regex(value, where)
        elif key == "$ref":
            if not isinstance(value, str) or not value.startswith("#"):
                raise GrammarError(
                    f"{where} must refer within the schema ('#/$defs/...'), got {json.dumps(value)[:60]}"
                )
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise GrammarError(f"{where} must be a list of property names")
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise GrammarError(f"{where} must be a non-empty list")
        elif key in _ONE:
            if key == "items" and isinstance(value, list):  # draft 4's tuple form
                for i, sub in enumerate(value):
                    check_schema(sub, f"{where}[{i}]", depth + 1)
            else:
                check_schema(value, where, depth + 1)
        elif key in _MAPS:
            if not isinstance(value, dict):
                raise GrammarError(f"{where} must be an object of schemas")
            for name, sub in value.items():
                check_schema(sub, f"{where}.{name}", depth + 1)
        elif key in _LISTS:
            if not isinstance(value, list) or not value:
                raise GrammarError(f"{where} must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}[{i}]", depth + 1)


def check_regex(pattern: str, where: str = "regex") -> None:
    """A regex's length and the bounds of its {m,n} repetitions (xgrammar expands them)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise GrammarError(f"{where} has {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    for m in _REPEAT.finditer(pattern):
        for bound in m.groups():
            if bound and int(bound) > MAX_REPEAT:
                raise GrammarError(
                    f"{where}: the repetition {m.group(0)} is over {MAX_REPEAT} (write a shorter bound or use * / +)"
                )


def check(spec: GrammarSpec) -> None:
    """Everything the front end checks of a grammar before a request reaches the leader:
    GrammarError naming the problem. Seconds at most for what passes the size checks (the
    caller runs it off the event loop with :data:`CHECK_TIMEOUT_S`)."""
    xgr = _xgrammar()
    try:
        if spec.kind == "json_schema":
            try:
                schema = json.loads(spec.text)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            check_schema(schema)
            grammar = json_grammar(spec)
        elif spec.kind == "json_object":
            grammar = json_grammar(spec)
        elif spec.kind == "regex":
            check_regex(spec.text)
            grammar = xgr.Grammar.from_regex(spec.text)
        else:
            grammar = xgr.Grammar.from_ebnf(spec.text)
    except GrammarError:
        raise
    except Exception as e:  # xgrammar's conversion refused it
        raise GrammarError(f"the {spec.kind.replace('_', ' ')} is not valid: {_message(e)}") from None
    size = len(str(grammar))
    if size > MAX_EBNF_CHARS:
        raise GrammarError(
            f"the {spec.kind.replace('_', ' ')} makes a grammar of {size} characters; at most {MAX_EBNF_CHARS}"
        )


# xgrammar (0.2.9) writes a string with minLength / maxLength as repetitions of this class, which
# lets raw control characters through (invalid JSON); its unbounded strings exclude them.
_LOOSE_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\\r\n]"


def json_grammar(spec: GrammarSpec):
    """xgrammar's grammar of a JSON spec (``json_schema`` or ``json_object``), its bounded
    strings' characters restricted to what JSON allows unescaped."""
    xgr = _xgrammar()
    text = spec.text if spec.kind == "json_schema" else '{"type": "object"}'
    grammar = xgr.Grammar.from_json_schema(text, **_json_options(spec))
    ebnf = str(grammar)
    if _LOOSE_CHARS not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_CHARS, _JSON_CHARS))


def _json_options(spec: GrammarSpec) -> dict:
    if spec.any_whitespace:
        return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}
    return {"any_whitespace": False}


# -- the routers' vocabulary and compiler -----------------------------------------------------


def vocabulary(tokenizer_file: str | Path, vocab_size: int) -> tuple[list[str], str, bool]:
    """The model's vocabulary as xgrammar reads it: (each id's token string [V], the vocabulary
    type, whether the tokenizer adds a prefix space). Special tokens and the ids past the
    tokenizer's (a model's padded vocabulary) are "": the grammar never allows them, the stop
    tokens aside."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    vocab = [""] * vocab_size
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if 0 <= i < vocab_size:
            vocab[i] = piece
    for i, added in tok.get_added_tokens_decoder().items():
        if added.special and 0 <= i < vocab_size:
            vocab[i] = ""
    spec = json.loads(tok.to_str())
    decoders = _parts(spec.get("decoder"))
    kinds = {d.get("type") for d in decoders}
    kind = "BYTE_LEVEL" if "ByteLevel" in kinds else "BYTE_FALLBACK" if "ByteFallback" in kinds else "RAW"
    prefix = any(
        p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") != "never"
        for p in _parts(spec.get("pre_tokenizer")) + _parts(spec.get("normalizer"))
    ) or any(p.get("type") == "Prepend" for p in _parts(spec.get("normalizer")))
    return vocab, kind, prefix


def _parts(node) -> list[dict]:
    if not isinstance(node, dict):
        return []
    inner = node.get("decoders") or node.get("pretokenizers") or node.get("normalizers")
    return [node] + [p for sub in inner or [] for p in _parts(sub)]


class Compiler:
    """A router's grammar compiler: the model's vocabulary (its ``tokenizer.json``, padded to the
    model's ``vocab_size``; the stop tokens are the model's EOS ids) and xgrammar's compiler
    (``threads`` threads per compile). Built on first use, which costs about a second at a 202k
    vocabulary (call :meth:`ready` in a thread at start)."""

    def __init__(self, tokenizer_file: str | Path | None, vocab_size: int, eos_ids, threads: int = 4):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_ids = sorted({int(t) for t in eos_ids})
        self.threads = threads
        self._compiler: Any = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def ready(self) -> None:
        """Build the vocabulary and the compiler (once); GrammarError when it cannot be."""
        with self._lock:
            if self._compiler is None and self._error is None:
                self._compiler, self._error = self._build()
        if self._error is not None:
            raise GrammarError(self._error)

    def _build(self):
        why = missing()
        if why:
            return None, why
        if self.tokenizer_file is None or not Path(self.tokenizer_file).is_file():
            return None, f"structured output needs the model's tokenizer.json on every router ({self.tokenizer_file})"
        xgr = _xgrammar()
        vocab, kind, prefix = vocabulary(self.tokenizer_file, self.vocab_size)
        info = xgr.TokenizerInfo(
            vocab,
            getattr(xgr.VocabType, kind),
            vocab_size=self.vocab_size,
            stop_token_ids=self.eos_ids,
            add_prefix_space=prefix,
        )
        return xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False), None

    def compile(self, spec: GrammarSpec):
        """The xgrammar ``CompiledGrammar`` of a checked spec (GrammarError if xgrammar refuses)."""
        self.ready()
        c = self._compiler
        try:
            if spec.kind in ("json_schema", "json_object"):
                return c.compile_grammar(json_grammar(spec))
            if spec.kind == "regex":
                return c.compile_regex(spec.text)
            return c.compile_grammar(spec.text)
        except Exception as e:
            raise GrammarError(f"the {spec.kind.replace('_', ' ')} could not be compiled: {_message(e)}") from None

    def matcher(self, compiled):
        """A fresh matcher of one sequence (microseconds)."""
        return _xgrammar().GrammarMatcher(compiled)

    def batch(self, threads: int):
        """xgrammar's batch mask filler (``threads`` threads)."""
        return _xgrammar().BatchGrammarMatcher(max_threads=threads)


__all__ = [
    "KINDS",
    "GrammarSpec",
    "GrammarError",
    "check",
    "check_schema",
    "check_regex",
    "choice_grammar",
    "missing",
    "preload",
    "vocabulary",
    "Compiler",
]
