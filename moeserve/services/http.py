"""The OpenAI-compatible HTTP API of the serving front end (Starlette on uvicorn, uvloop).

Routes, all on one port:

- ``POST /v1/completions``: ``prompt`` (a text, a list of texts, token ids or a list of lists
  of ids); ``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template.
  Parameters: model, max_tokens (chat: also max_completion_tokens), temperature, top_p, top_k,
  seed, stop (strings, matched on the decoded text across token boundaries, not included),
  stop_token_ids, ignore_eos, n (choice j gets seed + j when a seed is given), logprobs
  (completions: how many top tokens; chat: true with top_logprobs), stream with
  ``stream_options.include_usage`` (server-sent events ending with ``data: [DONE]``).
  Parameters moeserve does not support (penalties, logit_bias, tools, ...) answer 400 naming
  them; so do unknown ones.
- ``GET /v1/models``, ``GET /health`` (200 while the cluster can take a request; 503 while it
  cannot (the front end's readiness, ``moeserve.services.readiness``: the leader unreachable,
  its step loop stalled, the cluster failed) and while the server drains), ``GET /version``,
  ``GET /metrics`` (Prometheus: the front end's registry, the same series the gRPC path
  records).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 bad
request, 401 missing or wrong API key (``Authorization: Bearer <key>``, compared in constant
time; only ``/v1/`` routes are guarded), 404 unknown model or route, 413 a body over the limit,
429 the leader's admission queue is full, 503 the cluster is unavailable or the server drains.

Every request goes through :class:`moeserve.services.admission.Admission`, the path the gRPC
servicer takes: tokenization off the event loop, limits before conversion, one
``GenerateRequest`` per choice (the leader validates it once), events streamed from the leader.
A streamed response is sent once every choice has its first event, so that a refusal by the
leader (400, 429) still gets its status. A client that disconnects, before or during its
response, cancels its requests on the leader. Logprobs are the log-softmax of the logits the
engine returns with each token (``return_logits="last"``).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import secrets
import time
from dataclasses import dataclass, field

import numpy as np

from moeserve import __version__
from moeserve.router.engine.api import (EngineError, Finished, FinishReason, InvalidRequest, NotFound, QueueFull,
                                        Token, Unavailable)
from moeserve.sampling import MAX_SEED
from moeserve.services.admission import Admission, Detokenizer, StopStrings

MAX_N = 64
MAX_CHOICES = 256                  # prompts x n of one request
MAX_LOGPROBS = 20
MAX_BODY_BYTES = 64 << 20
PARSE_OFF_LOOP_BYTES = 256 << 10


def body_limit(limits) -> int:
    """The largest request body this front end reads (413 above it, before reading it): room for
    one prompt text of the most characters it tokenizes (up to 8 bytes a character in JSON with
    escapes), a batch of MAX_N prompts of ``max_model_len`` ids or text (12 bytes a token), and
    the other fields; a 50 MB list of ids is refused before a byte of it is parsed."""
    return 8 * limits.max_prompt_chars + 12 * MAX_N * limits.max_model_len + (1 << 20)
DEFAULT_COMPLETION_TOKENS = 16
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

# -- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """An answer in OpenAI's error shape with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self):
        return _json(self.body(), self.status)


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


def api_error(e: BaseException) -> ApiError:
    """The engine's exceptions (and anything else) as an HTTP answer."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, (InvalidRequest, ValueError)):
        return ApiError(400, str(e))
    if isinstance(e, QueueFull):
        return ApiError(429, str(e), code="queue_full")
    if isinstance(e, NotFound):
        return ApiError(404, str(e))
    if isinstance(e, (Unavailable, EngineError, OSError)):
        return ApiError(503, f"the cluster is unavailable: {e}", code="unavailable")
    return ApiError(500, f"{type(e).__name__}: {e}")


def _dumps(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def _json(obj, status: int = 200, headers: dict | None = None):
    from starlette.responses import Response
    return Response(_dumps(obj), status_code=status, media_type="application/json", headers=headers)


# -- parameters -------------------------------------------------------------------------------

def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo: int | None = None, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(f"{name} must be an integer, got {_show(v)}", name)
    if lo is not None and v < lo or hi is not None and v > hi:
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise bad(f"{name} must be {rng}, got {v}", name)
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v) or not math.isfinite(v):
        raise bad(f"{name} must be a finite number, got {_show(v)}", name)
    return float(v)


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
    "presence_penalty": lambda v: v == 0, "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1, "length_penalty": lambda v: v == 1,
    "logit_bias": lambda v: v == {}, "min_p": lambda v: v == 0, "min_tokens": lambda v: v == 0,
    "echo": lambda v: v is False, "suffix": lambda v: v == "", "best_of": lambda v: v == 1,
    "tools": lambda v: v == [], "tool_choice": lambda v: v in ("none", "auto"), "functions": lambda v: v == [],
    "function_call": lambda v: v in ("none", "auto"), "parallel_tool_calls": lambda v: isinstance(v, bool),
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "use_beam_search": lambda v: v is False, "continue_final_message": lambda v: v is False,
    "modalities": lambda v: v == ["text"], "priority": lambda v: v == 0, "prompt_logprobs": lambda v: False,
    "guided_json": lambda v: False, "guided_regex": lambda v: False, "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False, "structured_outputs": lambda v: False, "prediction": lambda v: False,
    "audio": lambda v: False, "reasoning_effort": lambda v: False, "web_search_options": lambda v: False,
    "logits_processors": lambda v: False, "bad_words": lambda v: v == [], "allowed_token_ids": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
}
IGNORED = {"user", "metadata", "store", "service_tier", "request_id"}
COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
          "stream", "stream_options", "logprobs", "skip_special_tokens", "include_stop_str_in_output"}
COMPLETION_KEYS = COMMON | {"prompt"}
CHAT_KEYS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
                      "chat_template_kwargs"}


def check_keys(body: dict, known: set[str]) -> None:
    unknown = sorted(k for k in body if k not in known and k not in UNSUPPORTED and k not in IGNORED)
    if unknown:
        raise bad(f"unknown parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}", unknown[0])
    refused = sorted(k for k in body if k in UNSUPPORTED and body[k] is not None and not _neutral(k, body[k]))
    if refused:
        raise bad(f"moeserve does not support {', '.join(refused)} (leave {'them' if len(refused) > 1 else 'it'} "
                  f"out or at the default)", refused[0])


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
    logprobs: int | None               # top tokens per position (0: the chosen token only); None: no logprobs
    skip_special_tokens: bool
    include_stop_str: bool


def parse_sampling(body: dict, chat: bool, max_stop_ids: int) -> Sampling:
    n = _int(body, "n", 1, 1, MAX_N)
    max_tokens = _int(body, "max_tokens", None, 1)
    if chat:
        mct = _int(body, "max_completion_tokens", None, 1)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise bad(f"max_tokens ({max_tokens}) and max_completion_tokens ({mct}) disagree: give one",
                      "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens
    elif max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_TOKENS
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad(f"temperature must be >= 0 (0 = greedy), got {temperature}", "temperature")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", 0, -1)
    seed = _int(body, "seed", None, 0, MAX_SEED)
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise bad(f"seed + n - 1 must be <= {MAX_SEED} (choice j is sampled with seed + j)", "seed")
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if stop is not None:
        items = [stop] if isinstance(stop, str) else stop
        if isinstance(items, list) and len(items) > 64:          # the length first: nothing else is read
            raise bad(f"stop has {len(items)} strings; at most 64", "stop")
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise bad(f"stop must be a string or a list of strings, got {_show(stop)}", "stop")
        if any(not s or len(s) > 1024 for s in items):
            raise bad("every stop string must have 1..1024 characters", "stop")
        stops = tuple(items)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list):
        raise bad(f"stop_token_ids must be a list of integers, got {_show(stop_ids)}", "stop_token_ids")
    if len(stop_ids) > max_stop_ids:
        raise bad(f"stop_token_ids has {len(stop_ids)} ids; at most {max_stop_ids}", "stop_token_ids")
    if not all(_is_int(t) for t in stop_ids):
        raise bad("stop_token_ids must be a list of integers", "stop_token_ids")
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
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and top > 0 and not want:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n and best_of != 1:
        raise bad("moeserve does not support best_of (other than n)", "best_of")
    return Sampling(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                    top_k=0 if top_k == -1 else top_k, seed=seed, stops=stops, stop_token_ids=stop_ids,
                    ignore_eos=_bool(body, "ignore_eos", False), stream=stream, include_usage=include_usage,
                    logprobs=logprobs, skip_special_tokens=_bool(body, "skip_special_tokens", True),
                    include_stop_str=_bool(body, "include_stop_str_in_output", False))


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
                    raise bad(f"{where}.content has a part of type {_show(kind)}: moeserve serves text only "
                              f"(parts of type 'text')", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise bad(f"{where}.content must be a string or a list of text parts, got {_show(content)}", "messages")
        msg = {k: v for k, v in m.items() if k not in ("content",)}
        msg["content"] = content
        out.append(msg)
    return out


# -- choices ----------------------------------------------------------------------------------

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


def log_softmax_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class Choice:
    """One choice's state: its text so far (stop strings cut it), its tokens and logprobs."""

    index: int
    detok: Detokenizer
    stops: StopStrings
    stop_ids: frozenset
    top_n: int | None
    include_stop: bool
    tokens: int = 0
    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    stop_reason: object = None
    last_token: int | None = None
    logprobs: list = field(default_factory=list)      # (token id, logprob, [(id, logprob)], text offset)

    def on_token(self, ev: Token) -> tuple[str, list]:
        self.tokens += 1
        self.last_token = ev.token_id
        entries = []
        if self.top_n is not None:
            lp = log_softmax_row(ev.logits[-1]) if ev.logits is not None else None
            if lp is None:
                raise Unavailable("the leader returned no logits for a request that asked for logprobs")
            top = []
            if self.top_n:
                k = min(self.top_n, lp.size)
                idx = np.argpartition(-lp, k - 1)[:k]
                idx = idx[np.argsort(-lp[idx], kind="stable")]
                top = [(int(t), float(lp[t])) for t in idx]
            entries.append((ev.token_id, float(lp[ev.token_id]), top, len(self.detok.text)))
            self.logprobs.extend(entries)
        self.detok.add(ev.token_id)
        out, stopped = self.stops.feed(self.detok.text)
        if stopped:
            self._stop(out)
            out = out + (self.stops.matched if self.include_stop else "")
        self.text += out
        return out, entries

    def _stop(self, out: str) -> None:
        self.done = True
        self.finish_reason = "stop"
        self.stop_reason = self.stops.matched

    def on_finish(self, reason) -> str:
        self.detok.flush()
        out, stopped = self.stops.feed(self.detok.text, final=True)
        self.done = True
        if stopped:
            self._stop(out)
            out = out + (self.stops.matched if self.include_stop else "")
        else:
            self.finish_reason = FINISH.get(reason, str(reason))
            if reason == FinishReason.STOP and self.last_token in self.stop_ids:
                self.stop_reason = self.last_token
        self.text += out
        return out


class Run:
    """The request streams of one HTTP request's choices, each iterated by a task of its own
    into one queue. Closing it (or a choice) cancels the requests on the leader."""

    def __init__(self, admission: Admission, reqs):
        self.streams = [admission.open(r) for r in reqs]
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list = []
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(self.streams)]

    async def _pump(self, i: int, stream) -> None:
        try:
            async for ev in stream:
                self.queue.put_nowait((i, ev))
            self.queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.queue.put_nowait((i, e))
        finally:
            await stream.aclose()

    async def prime(self) -> None:
        """Wait until every choice has its first event; raise the first refusal."""
        seen = set()
        while len(seen) < len(self.streams):
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            seen.add(i)
            self.buffer.append((i, item))

    async def next(self):
        if self.buffer:
            return self.buffer.pop(0)
        return await self.queue.get()

    def end(self, i: int, reason: str) -> None:
        """Choice ``i`` is done (a stop string): cancel its request on the leader."""
        self.streams[i].close_reason = reason
        self.tasks[i].cancel()

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def drive(run: Run, choices: list[Choice]):
    """(choice, new text, new logprob entries) as events arrive, until every choice is done."""
    left = sum(not c.done for c in choices)
    while left:
        i, item = await run.next()
        c = choices[i]
        if c.done:
            continue
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise Unavailable("the leader ended a request without a finish event")
        if isinstance(item, Token):
            text, entries = c.on_token(item)
            if c.done:
                run.end(i, "stop")
                left -= 1
            yield c, text, entries
        elif isinstance(item, Finished):
            text = c.on_finish(item.reason)
            left -= 1
            yield c, text, []


# -- the app ----------------------------------------------------------------------------------

async def _disconnected(receive) -> None:
    """Returns when the client has gone (call only once the request's body was read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _until_disconnect(receive, coro):
    """Run ``coro``; when the client goes away first, cancel it (its requests are cancelled)."""
    from starlette.responses import Response
    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        gone.cancel()
        await asyncio.wait({work, gone})
        raise
    gone.cancel()
    if work not in done:
        work.cancel()
        await asyncio.wait({work, gone})
        return Response(status_code=499)
    await asyncio.wait({gone})
    return work.result()


class EventStream:
    """A server-sent-events response from an async iterator of bytes; the client going away
    cancels it and closes the iterator (which cancels its requests)."""

    def __init__(self, chunks, headers: dict | None = None):
        self.chunks = chunks
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + \
            [(k.encode(), v.encode()) for k, v in {**SSE_HEADERS, **(headers or {})}.items()]

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        work = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            work.cancel()
            gone.cancel()
            await asyncio.wait({work, gone})
            await self.chunks.aclose()
        if work.done() and not work.cancelled() and work.exception() is not None \
                and not isinstance(work.exception(), OSError):
            raise work.exception()


def _sse(obj) -> bytes:
    return b"data: " + _dumps(obj) + b"\n\n"


class HttpApi:
    """The ASGI application (``app``) and its state.

    admission: the front end's shared admission path; served_models: the names a request's
    ``model`` may take (the first is the default); model_root: the model folder (shown by
    /v1/models); api_key: guards ``/v1/`` (None: open); registry: the Prometheus registry of
    /metrics (None: an empty answer); max_body_bytes: the largest request body (at most
    :func:`body_limit` of the admission limits).
    """

    def __init__(self, admission: Admission, served_models: list[str], model_root: str = "",
                 api_key: str | None = None, registry=None, max_body_bytes: int = MAX_BODY_BYTES):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        if not served_models:
            raise ValueError("give at least one served model name")
        self.admission = admission
        self.served_models = list(served_models)
        self.model_root = model_root
        self._key = api_key.encode() if api_key else None
        self.registry = registry
        self.max_body_bytes = min(max_body_bytes, body_limit(admission.limits))
        self.draining = False
        self.readiness = None          # moeserve.services.readiness.Readiness of the front end (None: ask the leader)
        self.created = int(time.time())
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"]),
                  Route("/version", self.version, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"])]

        async def http_error(request, exc: HTTPException):
            status = exc.status_code if exc.status_code in ERROR_TYPES else 400
            what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
            return ApiError(status, what.get(exc.status_code, str(exc.detail)),
                            code="not_found" if exc.status_code == 404 else None).response()

        async def server_error(request, exc: Exception):
            return api_error(exc).response()

        self.app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})

    # -- plumbing -----------------------------------------------------------------------------

    def _auth(self, request) -> None:
        if self._key is None:
            return
        auth = request.headers.get("authorization")
        if auth is None:
            raise ApiError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "the Authorization header must read 'Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self._key):
            raise ApiError(401, "wrong API key", code="invalid_api_key")

    async def _body(self, request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise ApiError(413, f"the request body has {length} bytes; at most {self.max_body_bytes}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ApiError(413, f"the request body is over {self.max_body_bytes} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:                                   # a large body is parsed off the event loop
            body = json.loads(raw) if len(raw) < PARSE_OFF_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad("the request body nests too deeply") from None
        if not isinstance(body, dict):
            raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
        return body

    def _model(self, body: dict) -> str:
        model = body.get("model")
        if model is None:
            return self.served_models[0]
        if not isinstance(model, str):
            raise bad(f"model must be a string, got {_show(model)}", "model")
        if model not in self.served_models:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves "
                                f"{', '.join(repr(m) for m in self.served_models)}", "model", "model_not_found")
        return model

    async def _generation(self, request, handler):
        try:
            if self.draining:
                raise ApiError(503, "the server is shutting down", code="unavailable")
            self._auth(request)
            body = await self._body(request)
        except ApiError as e:
            return e.response()
        try:
            return await _until_disconnect(request.receive, handler(body))
        except Exception as e:
            return api_error(e).response()

    # -- routes -------------------------------------------------------------------------------

    async def completions(self, request):
        return await self._generation(request, self._completions)

    async def chat_completions(self, request):
        return await self._generation(request, self._chat)

    async def models(self, request):
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        data = [{"id": m, "object": "model", "created": self.created, "owned_by": "moeserve",
                 "root": self.model_root or m, "parent": None, "max_model_len": self.admission.limits.max_model_len}
                for m in self.served_models]
        return _json({"object": "list", "data": data})

    async def health(self, request):
        if self.draining:
            return ApiError(503, "the server is shutting down", code="unavailable").response()
        r = self.readiness
        if r is not None:
            if not r.ready:
                return ApiError(503, f"the cluster cannot take a request ({r.reason}): {r.detail}",
                                code="unavailable").response()
            return _json({"status": "ok"})
        call = getattr(self.admission.engine, "call", None)
        if call is not None:
            try:
                await asyncio.wait_for(call("status"), 5.0)
            except Exception as e:
                return ApiError(503, f"the cluster is unavailable: {e}", code="unavailable").response()
        return _json({"status": "ok"})

    async def version(self, request):
        return _json({"version": __version__})

    async def metrics(self, request):
        from starlette.responses import Response
        if self.registry is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

    # -- generation ---------------------------------------------------------------------------

    async def _prompts(self, body: dict) -> list[tuple[int, ...]]:
        a = self.admission
        prompt = body.get("prompt")
        if prompt is None:
            raise bad("prompt is required: a string, a list of strings, a list of token ids or a list of lists", "prompt")
        if isinstance(prompt, str):
            return [await a.encode(prompt)]
        if not isinstance(prompt, list) or not prompt:
            raise bad(f"prompt must be a non-empty string or list, got {_show(prompt)}", "prompt")
        if _is_int(prompt[0]):                 # ids: the length is checked before any element is read
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
                raise bad("prompt must be a string, a list of strings, a list of token ids or a list of lists of "
                          f"token ids; found an element {_show(p)}", "prompt")
        return out

    def _requests(self, prompts, s: Sampling):
        a = self.admission
        if len(prompts) * s.n > MAX_CHOICES:
            raise bad(f"{len(prompts)} prompts x n = {s.n} make {len(prompts) * s.n} choices; at most {MAX_CHOICES}", "n")
        reqs, choices = [], []
        for ids in prompts:
            max_tokens = s.max_tokens if s.max_tokens is not None else max(1, a.limits.max_model_len - len(ids))
            for j in range(s.n):
                seed = s.seed + j if s.seed is not None else None
                reqs.append(a.request(ids, max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                      seed=seed, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos,
                                      return_logits="last" if s.logprobs is not None else ""))
                choices.append(Choice(len(choices), Detokenizer(a.tokenizer, s.skip_special_tokens),
                                      StopStrings(s.stops), frozenset(s.stop_token_ids), s.logprobs,
                                      s.include_stop_str))
        if s.stops and a.tokenizer is None:
            raise bad("stop strings need the model's tokenizer (this server has none): use stop_token_ids", "stop")
        return reqs, choices

    async def _completions(self, body: dict):
        check_keys(body, COMPLETION_KEYS)
        model = self._model(body)
        s = parse_sampling(body, False, self.admission.limits.max_stop_ids)
        prompts = await self._prompts(body)
        return await self._respond(model, prompts, s, chat=False)

    async def _chat(self, body: dict):
        check_keys(body, CHAT_KEYS)
        model = self._model(body)
        s = parse_sampling(body, True, self.admission.limits.max_stop_ids)
        messages = parse_messages(body)
        add_gen = _bool(body, "add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad(f"chat_template_kwargs must be an object, got {_show(kwargs)}", "chat_template_kwargs")
        reserved = sorted(set(kwargs or {}) & {"messages", "add_generation_prompt", "tools", "documents"})
        if reserved:
            raise bad(f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        ids = await self.admission.chat_ids(messages, add_gen, kwargs)
        return await self._respond(model, [ids], s, chat=True)

    async def _respond(self, model: str, prompts, s: Sampling, chat: bool):
        reqs, choices = self._requests(prompts, s)
        prompt_tokens = sum(len(p) for p in prompts)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        run = Run(self.admission, reqs)
        try:
            if s.stream:
                await run.prime()
                return EventStream(self._chunks(run, choices, rid, created, model, prompt_tokens, s, chat),
                                   {"x-request-id": rid})
            async for _ in drive(run, choices):
                pass
        except BaseException:
            await run.close()
            raise
        await run.close()
        usage = _usage(prompt_tokens, choices)
        if chat:
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c.logprobs) if s.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
            body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
                    "usage": usage}
        else:
            out = [{"index": c.index, "text": c.text,
                    "logprobs": self._completion_logprobs(c.logprobs) if s.logprobs is not None else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in choices]
            body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out,
                    "usage": usage}
        return _json(body, headers={"x-request-id": rid})

    async def _chunks(self, run: Run, choices, rid, created, model, prompt_tokens, s: Sampling, chat: bool):
        kind = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if s.include_usage else {}

        def chunk(parts):
            return _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": parts, **extra})

        try:
            if chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for c, text, entries in drive(run, choices):
                if not text and not entries and not c.done:
                    continue
                lp = None
                if s.logprobs is not None:
                    lp = self._chat_logprobs(entries) if chat else self._completion_logprobs(entries)
                part = {"index": c.index, "logprobs": lp, "finish_reason": c.finish_reason if c.done else None}
                if c.done:
                    part["stop_reason"] = c.stop_reason
                if chat:
                    part["delta"] = {"content": text} if text else {}
                else:
                    part["text"] = text
                yield chunk([part])
            if s.include_usage:
                yield _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                            "usage": _usage(prompt_tokens, choices)})
        except Exception as e:
            yield _sse(api_error(e).body())
        finally:
            await run.close()
        yield b"data: [DONE]\n\n"

    def _completion_logprobs(self, entries) -> dict:
        tok = self.admission.tokenizer
        text = tok.token_text if tok is not None else str
        return {"tokens": [text(t) for t, _, _, _ in entries],
                "token_logprobs": [_finite(lp) for _, lp, _, _ in entries],
                "top_logprobs": [{**{text(i): _finite(v) for i, v in top}, text(t): _finite(lp)}
                                 for t, lp, top, _ in entries],
                "text_offset": [off for _, _, _, off in entries]}

    def _chat_logprobs(self, entries) -> dict:
        tok = self.admission.tokenizer

        def one(t, lp):
            if tok is None:
                return {"token": str(t), "logprob": _finite(lp), "bytes": None}
            return {"token": tok.token_text(t), "logprob": _finite(lp), "bytes": list(tok.token_bytes(t))}

        return {"content": [{**one(t, lp), "top_logprobs": [one(i, v) for i, v in top]} for t, lp, top, _ in entries],
                "refusal": None}


def _usage(prompt_tokens: int, choices) -> dict:
    done = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": done, "total_tokens": prompt_tokens + done}


# -- the server -------------------------------------------------------------------------------

class HttpServer:
    """``api`` on uvicorn on the running event loop (no signal handlers of its own: the
    process's owner stops it). :meth:`start` binds ``host:port`` (0: a free port) and returns
    the port; :meth:`stop` drains: new requests answer 503, in-flight ones get ``grace_s``."""

    def __init__(self, api: HttpApi, host: str = "127.0.0.1", port: int = 0, grace_s: float = 30.0):
        self.api, self.host, self.port, self.grace_s = api, host, port, grace_s
        self.server = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        import contextlib
        import socket

        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):                  # the front end owns SIGTERM and SIGINT
                return contextlib.nullcontext()

            def install_signal_handlers(self):          # uvicorn < 0.29
                pass

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot serve HTTP on {self.host}:{self.port}: {e.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.api.app, log_config=None, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=max(1, int(math.ceil(self.grace_s))), server_header=False,
                                timeout_keep_alive=30)
        self.server = Server(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self.api.draining = True
        if self.server is None or self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.grace_s + 10)
        except asyncio.TimeoutError:
            self.server.force_exit = True
            self._task.cancel()


__all__ = ["HttpApi", "HttpServer", "ApiError", "api_error", "log_softmax_row"]
