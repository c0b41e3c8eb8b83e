"""Request parsing for the OpenAI-compatible HTTP API (``moeserve.services.http``): which
parameters a request may carry, their types and ranges, and what they become (a
:class:`Sampling` every choice of the request shares, the prompts in token ids, the chat
messages as the template sees them). Every refusal is an :class:`~moeserve.services.http.encode.ApiError`
(400) that names the parameter.

Parameters of OpenAI's or vLLM's API that moeserve does not support answer 400 naming them
unless they hold their "not used" value; unknown ones are refused too (a typo is not silently
ignored).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from moeserve.services.http.encode import ApiError, bad
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
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "length_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {},
    "min_p": lambda v: v == 0,
    "min_tokens": lambda v: v == 0,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: v == 1,
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),
    "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"),
    "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "use_beam_search": lambda v: v is False,
    "continue_final_message": lambda v: v is False,
    "modalities": lambda v: v == ["text"],
    "priority": lambda v: v == 0,
    "prompt_logprobs": lambda v: False,
    "guided_json": lambda v: False,
    "guided_regex": lambda v: False,
    "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False,
    "structured_outputs": lambda v: False,
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
}
COMPLETION_KEYS = COMMON | {"prompt"}
CHAT_KEYS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
}


def check_keys(body: dict, known: set[str]) -> None:
    unknown = sorted(k for k in body if k not in known and k not in UNSUPPORTED and k not in IGNORED)
    if unknown:
        raise bad(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", unknown[0])
    refused = sorted(k for k in body if k in UNSUPPORTED and body[k] is not None and not _neutral(k, body[k]))
    if refused:
        raise bad(
            f"moeserve does not support {', '.join(refused)} (leave {'them' if len(refused) > 1 else 'it'} "
            f"out or at the default)",
            refused[0],
        )


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


def _bounded(body: dict, name: str, limits, default=None):
    return bounded(name, body.get(name), limits, default)


def parse_sampling(body: dict, chat: bool, limits) -> Sampling:
    """The request's sampling parameters, each checked against its row of
    ``moeserve.services.limits.BOUNDS`` (``limits``: the front end's ``AdmissionLimits``)."""
    n = _bounded(body, "n", limits, 1)
    max_tokens = _bounded(body, "max_tokens", limits)
    if chat:
        mct = _bounded(body, "max_completion_tokens", limits)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise bad(
                f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) disagree: give one",
                "max_completion_tokens",
            )
        max_tokens = mct if mct is not None else max_tokens
    elif max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_TOKENS
    temperature = _bounded(body, "temperature", limits, 1.0)
    top_p = _bounded(body, "top_p", limits, 1.0)
    top_k = _bounded(body, "top_k", limits, 0)
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
    include_usage = False
    if opts is not None:
        if not stream:
            raise bad("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict):
            raise bad(f"stream_options must be an object, got {_show(opts)}", "stream_options")
        unknown = sorted(set(opts) - {"include_usage"})
        if unknown:
            raise bad(f"stream_options has unsupported keys {unknown}; supported: include_usage", "stream_options")
        include_usage = _bool(opts, "include_usage", False)
    if chat:
        want = _bool(body, "logprobs", False)
        top = _bounded(body, "top_logprobs", limits)
        if top is not None and top > 0 and not want:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _bounded(body, "logprobs", limits)
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
    )


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
        if m.get("tool_calls"):
            raise bad(f"{where} has tool_calls: moeserve does not support tools", "messages")
        content = m.get("content")
        if content is None:
            if role != "assistant":
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
