"""The bounds of what a client may send, in one place: every numeric request field's range
(:data:`BOUNDS`), and the size budget of a whole request (:func:`request_cost`), both checked
where a request is parsed, before anything is rendered, tokenized or converted.

A field's bound is its own (``n`` <= 64), a limit of the serving cluster (``max_tokens`` <=
``max_model_len``, ``top_k`` <= the vocabulary) or what the wire carries (an id in int64, a
count in int32). A value out of range is a :class:`BoundError` (an ``InvalidRequest``: HTTP 400,
gRPC INVALID_ARGUMENT) that names the field and the range allowed. New parameters add a row to
:data:`BOUNDS` and read their values with :func:`bounded`; the leader checks what only it knows
once more as it admits a request (``router.engine.api.validate_request``: the vocabulary, the KV
cache), so a request the front end let through can never fail a step.

The budget counts a request as its JSON shows it, before any conversion: every character of
every string (keys included) and one unit per value (a number, an element, an object), over the
whole body: messages with every field, template variables, stop strings, unknown fields. A
request over the budget is refused before a chat template renders it or a tokenizer sees it,
so the work and memory a request costs the front end follow its size, which the budget bounds.
The same walk refuses text that is not valid Unicode (a lone surrogate, which JSON's ``\\ud800``
escapes can carry): a tokenizer would fail on it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from moeserve.router.engine.api import InvalidRequest
from moeserve.sampling import MAX_BIAS, MAX_MIN_TOKENS, MAX_REPETITION_PENALTY, MAX_SEED

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
MAX_N = 64  # choices per prompt
MAX_CHOICES = 256  # prompts x n of one request
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
REQUEST_BUDGET_SLACK = 64 << 10  # units of a request's other fields beside its prompts


class BoundError(InvalidRequest):
    """A request field outside its range; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Bound:
    """The range of one numeric field: ``lo`` .. ``hi`` (inclusive unless ``lo_open`` /
    ``hi_open``), each a number or a function of the front end's limits (an
    ``admission.AdmissionLimits``: ``max_model_len``, ``vocab_size``); ``integer``: only
    integers; ``means``: what the special values mean, shown in the error."""

    lo: float | Callable
    hi: float | Callable
    integer: bool = True
    lo_open: bool = False
    hi_open: bool = False
    means: str = ""
    shown: str = ""  # the values in words, their kind included, instead of lo..hi

    def range(self, limits) -> tuple[float, float]:
        lo = self.lo(limits) if callable(self.lo) else self.lo
        hi = self.hi(limits) if callable(self.hi) else self.hi
        return lo, hi

    def text(self, limits, kind: bool = False) -> str:
        """The allowed values in words: "in 1..64", "an integer in 1..64" (with ``kind``)."""
        lo, hi = self.range(limits)
        if self.shown:  # the whole phrase, its kind included
            return f"{self.shown} ({self.means})" if self.means else self.shown
        if self.integer and not self.lo_open and not self.hi_open:
            out = f"in {_num(lo)}..{_num(hi)}"
        else:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            out = f"in {left}{_num(lo)}, {_num(hi)}{right}"
        if kind:
            out = f"{'an integer' if self.integer else 'a finite number'} {out}"
        return f"{out} ({self.means})" if self.means else out


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, int) or float(x).is_integer() and abs(x) < 1e16 else repr(float(x))


def _vocab(limits) -> int:
    """The vocabulary size the front end knows (the model folder's config.json), else what a
    token id can be on the wire (the leader checks the vocabulary)."""
    return limits.vocab_size if getattr(limits, "vocab_size", None) else INT32_MAX


def _max_logprobs(limits) -> int:
    """The most top logprobs a request may ask for (``--max-logprobs``)."""
    return getattr(limits, "max_logprobs", MAX_LOGPROBS)


FLOAT_MAX = 1.7976931348623157e308

# Every numeric field of a generation request (HTTP names; the gRPC fields are the same).
BOUNDS: dict[str, Bound] = {
    "n": Bound(1, MAX_N),
    "max_tokens": Bound(1, lambda lim: lim.max_model_len),
    "max_completion_tokens": Bound(1, lambda lim: lim.max_model_len),
    "temperature": Bound(0, FLOAT_MAX, integer=False, means="0 = greedy", shown="a finite number >= 0"),
    "top_p": Bound(0, 1, integer=False, lo_open=True, means="1 = no nucleus filtering"),
    "top_k": Bound(-1, _vocab, means="0 or -1 = no top-k filtering, at most the vocabulary"),
    "min_p": Bound(0, 1, integer=False, means="0 = no min-p filtering"),
    "presence_penalty": Bound(-2, 2, integer=False),
    "frequency_penalty": Bound(-2, 2, integer=False),
    "repetition_penalty": Bound(0, MAX_REPETITION_PENALTY, integer=False, lo_open=True, means="1 = no penalty"),
    "min_tokens": Bound(0, MAX_MIN_TOKENS),
    "logit_bias": Bound(-MAX_BIAS, MAX_BIAS, integer=False),
    "seed": Bound(0, MAX_SEED),
    "logprobs": Bound(0, _max_logprobs, means="--max-logprobs"),
    "top_logprobs": Bound(0, _max_logprobs, means="--max-logprobs"),
    "prompt_logprobs": Bound(0, _max_logprobs, means="--max-logprobs"),
    "token_id": Bound(0, _vocab, hi_open=True, means="an id of the vocabulary"),
}


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def bounded(name: str, value, limits, default=None, what: str | None = None):
    """``value`` of field ``name`` checked against ``BOUNDS[name]`` (None: ``default``), as an
    int or a float; a BoundError naming ``what`` (default ``name``) and the range otherwise."""
    if value is None:
        return default
    b = BOUNDS[name]
    what = what or name
    if (
        not _is_int(value)
        if b.integer
        else isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    ):
        raise BoundError(f"{what} must be {b.text(limits, kind=True)}, got {_show(value)}", name)
    lo, hi = b.range(limits)
    if value < lo or value > hi or b.lo_open and value == lo or b.hi_open and value == hi:
        raise BoundError(f"{what} must be {b.text(limits)}, got {_show(value)}", name)
    return value if b.integer else float(value)


def token_ids(ids, limits, what: str = "prompt token ids", param: str | None = "prompt") -> tuple[int, ...]:
    """A list of ids from a client as a tuple of ints, each an id of the vocabulary the front
    end knows (any sized sequence: a JSON list, a protobuf repeated field)."""
    hi = _vocab(limits)
    out = []
    for t in ids:
        if not _is_int(t):
            raise BoundError(f"{what} must be a list of integers, found {_show(t)}", param)
        if not 0 <= t < hi:
            where = "the vocabulary" if getattr(limits, "vocab_size", None) else "the ids an int32 holds"
            raise BoundError(f"{what}: {t} is outside {where} [0, {hi})", param)
        out.append(int(t))
    return tuple(out)


# -- the size budget of a whole request ---------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def request_budget(limits) -> int:
    """Units one request may cost: room for a prompt of the most characters the front end
    tokenizes, or a batch of MAX_N prompts of ``max_model_len`` ids, and the other fields."""
    return max(limits.max_prompt_chars, MAX_N * limits.max_model_len) + REQUEST_BUDGET_SLACK


def request_cost(body, budget: int) -> int:
    """The units of ``body`` (parsed JSON): characters of every string, keys included, and one
    per value; BoundError once it passes ``budget`` (the walk stops there) or when a string is
    not valid Unicode. Iterative: a deep body costs no recursion."""
    units = 0
    todo = [body]
    while todo:
        v = todo.pop()
        units += 1
        if isinstance(v, str):
            units += len(v)
            if not v.isascii() and _SURROGATE.search(v):
                raise BoundError("the request holds text that is not valid Unicode (a lone surrogate)")
        elif isinstance(v, dict):
            for k, x in v.items():
                units += len(k) if isinstance(k, str) else 1
                if isinstance(k, str) and not k.isascii() and _SURROGATE.search(k):
                    raise BoundError("the request holds text that is not valid Unicode (a lone surrogate)")
                todo.append(x)
        elif isinstance(v, list):
            todo.extend(v)
        if units > budget:
            raise BoundError(
                f"the request is larger than this server takes ({budget} units: one per character of "
                f"every string and one per value; its prompts may have up to {budget - REQUEST_BUDGET_SLACK})"
            )
    return units


def check_text(text: str, what: str = "the text") -> None:
    """Text from a client that is not valid Unicode (a lone surrogate) is a BoundError."""
    if not text.isascii() and _SURROGATE.search(text):
        raise BoundError(f"{what} is not valid Unicode (it holds a lone surrogate)")


__all__ = [
    "Bound",
    "BoundError",
    "BOUNDS",
    "bounded",
    "token_ids",
    "request_budget",
    "request_cost",
    "check_text",
    "INT32_MAX",
    "INT64_MAX",
    "MAX_N",
    "MAX_CHOICES",
    "MAX_LOGPROBS",
]
