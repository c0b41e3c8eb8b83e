"""Request parsing for the OpenAI-compatible HTTP API (``moeserve.services.http``): which
parameters a request may carry, their types and ranges, and what they become (a
:class:`Sampling` every choice of the request shares, the prompts in token ids, the chat
messages as the template sees them). Every refusal is an :class:`~moeserve.services.http.encode.ApiError`
(400) that names the parameter.

Parameters of OpenAI's or vLLM's API that moeserve does not support answer 400 naming them
unless they hold their "not used" value; unknown ones are ignored with a logged warning, as
vLLM does (they still count against the request's body limit). Every number is checked against
its range where it is read: the 400 names the range.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from moeserve.grammar import GrammarSpec
from moeserve.router.engine.api import MAX_CACHE_SALT_BYTES
from moeserve.sampling import MAX_LOGIT_BIAS
from moeserve.services.http.encode import ApiError, bad
from moeserve.services.http.structured import STRUCTURED_KEYS, parse_structured
from moeserve.services.limits import (
    MAX_N,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    bounded,
    token_ids,
)

MAX_BODY_BYTES = 64 << 20
PARSE_OFF_LOOP_BYTES = 256 << 10


def body_limit(limits) -> int:
    """The largest request body this front end reads (413 above it, before reading it): room for
    one prompt text of the most characters it tokenizes (up to 8 bytes a character in JSON with
    escapes), a batch of MAX_N prompts of ``max_model_len`` ids or text (12 bytes a token), and
    the other fields; a 50 MB list of ids is refused before a byte of it is parsed."""
    return 8 * limits.max_prompt_chars + 12 * MAX_N * limits.max_model_len + (1 << 20)


DEFAULT_COMPLETION_TOKENS = 16


# -- parameters -------------------------------------------------------------------------------


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {_show(v)}", name)
    return v


# Parameters of OpenAI's or vLLM's API that moeserve does not support, each with the values
# that mean "not used" (accepted); None always means not used.
UNSUPPORTED = {
    "length_penalty": lambda v: v == 1,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "use_beam_search": lambda v: v is False,
    "continue_final_message": lambda v: v is False,
    "modalities": lambda v: v == ["text"],
    "priority": lambda v: v == 0,
    "prediction": lambda v: False,
    "audio": lambda v: False,
    "reasoning_effort": lambda v: False,
    "web_search_options": lambda v: False,
    "logits_processors": lambda v: False,
    "bad_words": lambda v: v == [],
    "allowed_token_ids": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
}
IGNORED = {"user", "metadata", "store", "service_tier", "request_id"}
COMMON = {
    "model",
    "n",
    "max_tokens",
    "max_completion_tokens",
    "min_p",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "prompt_logprobs",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "logprobs",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "return_token_ids",
    "cache_salt",
} | STRUCTURED_KEYS
COMPLETION_KEYS = COMMON | {"prompt", "echo"}
CHAT_KEYS = COMMON | {
    "messages",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
}


def check_keys(body: dict, known: set[str]) -> list[str]:
    """The fields of ``body`` this API does not know (ignored, as vLLM ignores them: the caller
    logs them); 400 for a parameter moeserve does not support, unless at its "not used" value."""
    unknown = sorted(k for k in body if k not in known and k not in UNSUPPORTED and k not in IGNORED)
    refused = sorted(
        k for k in body if k in UNSUPPORTED and k not in known and body[k] is not None and not _neutral(k, body[k])
    )
    if refused:
        raise bad(
            f"moeserve does not support {', '.join(refused)} (leave {'them' if len(refused) > 1 else 'it'} "
            f"out or at the default)",
            refused[0],
        )
    return unknown


def _neutral(name: str, value) -> bool:
    try:
        return bool(UNSUPPORTED[name](value))
    except Exception:
        return False


@dataclass
class Sampling:
    """What every choice of one request shares."""

    n: int
    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: tuple[str, ...]
    stop_token_ids: list
    ignore_eos: bool
    stream: bool
    include_usage: bool
    logprobs: int | None  # top tokens per position (0: the chosen token only); None: no logprobs
    skip_special_tokens: bool
    include_stop_str: bool
    return_token_ids: bool = False  # vLLM's extension: each choice (and chunk) carries its token ids
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    echo: bool = False  # completions: the prompt's text (and with logprobs its tokens' logprobs) first
    prompt_logprobs: int | None = None  # vLLM's extension: top tokens per prompt position
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage in every chunk

    cache_salt: str = ""  # vLLM's extension: cached KV blocks are shared only within one salt
    grammar: GrammarSpec | None = None  # structured output: what the tokens must follow

    @property
    def prompt_top(self) -> int:
        """Top tokens per prompt position the engine must score (-1: none)."""
        want = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(want) if want else -1


def _bounded(body: dict, name: str, limits, default=None):
    return bounded(name, body.get(name), limits, default)


# The sampling defaults a model's generation_config.json may set (vLLM's names there).
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def parse_sampling(body: dict, chat: bool, limits, defaults: dict | None = None) -> Sampling:
    """The request's sampling parameters, each checked against its row of
    ``moeserve.services.limits.BOUNDS`` (``limits``: the front end's ``AdmissionLimits``; top
    logprobs are bounded by its ``max_logprobs``, ``--max-logprobs``), with ``defaults`` (the
    model's generation config: :data:`GENERATION_DEFAULTS`) where the request gives none."""
    d = defaults or {}
    n = _bounded(body, "n", limits, 1)
    max_tokens = _bounded(body, "max_tokens", limits)
    mct = _bounded(body, "max_completion_tokens", limits)
    if mct is not None and max_tokens is not None and mct != max_tokens:
        raise bad(
            f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) disagree: give one",
            "max_completion_tokens",
        )
    max_tokens = mct if mct is not None else max_tokens
    if max_tokens is None:
        max_tokens = d.get("max_tokens") or (None if chat else DEFAULT_COMPLETION_TOKENS)
    temperature = _bounded(body, "temperature", limits, d.get("temperature", 1.0))
    top_p = _bounded(body, "top_p", limits, d.get("top_p", 1.0))
    top_k = _bounded(body, "top_k", limits, d.get("top_k", 0))
    min_p = _bounded(body, "min_p", limits, d.get("min_p", 0.0))
    presence = _bounded(body, "presence_penalty", limits, 0.0)
    frequency = _bounded(body, "frequency_penalty", limits, 0.0)
    repetition = _bounded(body, "repetition_penalty", limits, d.get("repetition_penalty", 1.0))
    min_tokens = _bounded(body, "min_tokens", limits, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad(f"min_tokens must be in 0..{max_tokens} (at most max_tokens), got {min_tokens}", "min_tokens")
    logit_bias = parse_logit_bias(body, limits)
    seed = _bounded(body, "seed", limits)
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise bad(f"seed + n - 1 must be <= {MAX_SEED} (choice j is sampled with seed + j)", "seed")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if isinstance(items, list) and len(items) > MAX_STOP_STRINGS:  # the length first: nothing else is read
            raise bad(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad(f"stop must be a string or a list of strings, got {_show(stop)}", "stop")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in items):
            raise bad(f"every stop string must have 1..{MAX_STOP_STRING_CHARS} characters", "stop")
        stops = tuple(items)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list):
        raise bad(f"stop_token_ids must be a list of integers, got {_show(stop_ids)}", "stop_token_ids")
    if len(stop_ids) > limits.max_stop_ids:
        raise bad(f"stop_token_ids has {len(stop_ids)} ids; at most {limits.max_stop_ids}", "stop_token_ids")
    stop_ids = list(token_ids(stop_ids, limits, "stop_token_ids", "stop_token_ids"))
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise bad(f"stream_options must be an object, got {_show(opts)}", "stream_options")
        unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
        if unknown:
            raise bad(
                f"stream_options has unsupported keys {unknown}; supported: include_usage, continuous_usage_stats",
                "stream_options",
            )
        include_usage = _bool(opts, "include_usage", False)
        continuous = _bool(opts, "continuous_usage_stats", False)
    if chat:
        want = _bool(body, "logprobs", False)
        top = _bounded(body, "top_logprobs", limits)
        if top is not None and top > 0 and not want:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _bounded(body, "logprobs", limits)
    prompt_logprobs = _bounded(body, "prompt_logprobs", limits)
    echo = False if chat else _bool(body, "echo", False)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt.encode()) > MAX_CACHE_SALT_BYTES):
        raise bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes", "cache_salt")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n and best_of != 1:
        raise bad("moeserve does not support best_of (other than n)", "best_of")
    return Sampling(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0 if top_k == -1 else top_k,
        seed=seed,
        stops=stops,
        stop_token_ids=stop_ids,
        ignore_eos=_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str=_bool(body, "include_stop_str_in_output", False),
        return_token_ids=_bool(body, "return_token_ids", False),
        min_p=min_p,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        min_tokens=min_tokens,
        logit_bias=logit_bias,
        echo=echo,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=include_usage and continuous,
        cache_salt=salt or "",
        grammar=parse_structured(body),
    )


def parse_logit_bias(body: dict, limits) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token ids (as strings of ASCII digits) to a bias,
    at most MAX_LOGIT_BIAS of them (the count is checked before anything else is read); each id
    against the vocabulary the front end knows and each bias against its row of ``BOUNDS``."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise bad(f"logit_bias must be an object of token id -> bias, got {_show(raw)}", "logit_bias")
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias has {len(raw)} tokens; at most {MAX_LOGIT_BIAS}", "logit_bias")
    out = []
    for k, v in raw.items():
        key = k.strip() if isinstance(k, str) else ""
        # ASCII only: str.isdigit() takes "²", which int() refuses
        if not key.isascii() or not key.isdigit() or len(key) > 10:
            raise bad(f"logit_bias keys must be token ids (integers >= 0), got {_show(k)}", "logit_bias")
        (tid,) = token_ids([int(key)], limits, "logit_bias keys", "logit_bias")
        out.append((tid, bounded("logit_bias", v, limits, what=f"the logit_bias of token {tid}")))
    return tuple(sorted(out))


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(body: dict) -> list[dict]:
    """The messages as the chat template sees them: content as a string (text parts joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with role and content, got {_show(m)}", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}", "messages")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise bad(f"{where}.tool_calls must be a list of objects, got {_show(calls)}", "messages")
        content = m.get("content")
        if content is None:
            if role not in ("assistant", "tool"):
                raise bad(f"{where}.content is missing", "messages")
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise bad(
                        f"{where}.content has a part of type {_show(kind)}: moeserve serves text only "
                        f"(parts of type 'text')",
                        "messages",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts, got {_show(content)}", "messages")
        msg = {k: v for k, v in m.items() if k not in ("content",)}
        msg["content"] = content
        out.append(msg)
    return out


async def parse_prompts(body: dict, admission) -> list[tuple[int, ...]]:
    """/v1/completions' ``prompt`` in token ids (texts tokenized off the event loop by
    ``admission``; lengths checked before anything is converted)."""
    a = admission
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt is required: a string, a list of strings, a list of token ids or a list of lists", "prompt")
    if isinstance(prompt, str):
        return [await a.encode(prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad(f"prompt must be a non-empty string or list, got {_show(prompt)}", "prompt")
    if _is_int(prompt[0]):  # ids: the length is checked before any element is read
        return [a.token_ids(prompt)]
    if len(prompt) > MAX_N:
        raise bad(f"prompt is a batch of {len(prompt)}; at most {MAX_N}", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(await a.encode(p))
        elif isinstance(p, list) and p and _is_int(p[0]):
            out.append(a.token_ids(p))
        else:
            raise bad(
                "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                f"token ids; found an element {_show(p)}",
                "prompt",
            )
    return out


def parse_chat_options(body: dict) -> tuple[bool, dict | None]:
    """(add_generation_prompt, chat_template_kwargs) of a chat request."""
    add_gen = _bool(body, "add_generation_prompt", True)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad(f"chat_template_kwargs must be an object, got {_show(kwargs)}", "chat_template_kwargs")
    reserved = sorted(set(kwargs or {}) & {"messages", "add_generation_prompt", "tools", "documents"})
    if reserved:
        raise bad(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    return add_gen, kwargs


def parse_model(body: dict, served_models: list[str]) -> str:
    """The served model name a request names (the first when it names none); 404 for another."""
    model = body.get("model")
    if model is None:
        return served_models[0]
    if not isinstance(model, str):
        raise bad(f"model must be a string, got {_show(model)}", "model")
    if model not in served_models:
        raise ApiError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(repr(m) for m in served_models)}",
            "model",
            "model_not_found",
        )
    return model
