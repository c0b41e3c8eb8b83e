"""The OpenAI-compatible HTTP API of the serving front end (Starlette on uvicorn, uvloop).

Routes, all on one port:

- ``POST /v1/completions``: ``prompt`` (a text, a list of texts, token ids or a list of lists
  of ids); ``POST /v1/chat/completions``: ``messages`` rendered with the model's chat template.
  Parameters: model, max_tokens (chat: also max_completion_tokens), temperature, top_p, top_k,
  seed, stop (strings, matched on the decoded text across token boundaries, not included),
  stop_token_ids, ignore_eos, n (choice j gets seed + j when a seed is given), logprobs
  (completions: how many top tokens; chat: true with top_logprobs), stream with
  ``stream_options.include_usage`` (server-sent events ending with ``data: [DONE]``),
  return_token_ids (vLLM's extension: each choice carries ``token_ids``, every id it generated,
  and each streamed chunk the ids it adds; completions' choices carry ``prompt_token_ids``, in
  the first chunk of each choice when streamed; chat carries them at the top level, in the
  first chunk when streamed). Parameters moeserve does not support (penalties, logit_bias,
  tools, ...) answer 400 naming them; so do unknown ones.
- ``GET /v1/models``, ``GET /health`` (200 while the cluster can take a request; 503 while it
  cannot (the front end's readiness, ``moeserve.services.readiness``: the leader unreachable,
  its step loop stalled, the cluster failed) and while the server drains), ``GET /version``,
  ``GET /metrics`` (Prometheus: the front end's registry, the same series the gRPC path
  records).

Without a tokenizer (a model folder without ``tokenizer.json``) a completion takes token ids
only (text and chat are 400); its text is empty and a streamed answer still sends one chunk
per token (its ``token_ids`` with return_token_ids), so a client sees every token arrive.

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

The parts: this module (the Starlette app: routes, auth, body, generation), ``params``
(request parsing and validation of the OpenAI parameters), ``choices`` (each choice's
state, the request streams of a request, cancellation), ``encode`` (JSON, errors,
server-sent events, logprobs and usage), ``tokens`` (/tokenize and /detokenize), ``server``
(uvicorn, TLS).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from moeserve.router.engine.api import Unavailable
from moeserve.services.admission import Admission, stream_coalescing
from moeserve.services.http.choices import FINISH, Choice, Run, drive, log_softmax_row
from moeserve.services.http.encode import (
    ERROR_TYPES,
    SSE_DONE,
    SSE_HEADERS,
    ApiError,
    EventStream,
    api_error,
    bad,
    disconnected,
    json_response,
    logprobs_part,
    prompt_logprobs_part,
    sse,
    usage,
)
from moeserve.services.http.params import (
    CHAT_KEYS,
    CHAT_ROLES,
    COMMON,
    COMPLETION_KEYS,
    DEFAULT_COMPLETION_TOKENS,
    IGNORED,
    MAX_BODY_BYTES,
    PARSE_OFF_LOOP_BYTES,
    UNSUPPORTED,
    Sampling,
    body_limit,
    check_keys,
    parse_chat_options,
    parse_messages,
    parse_model,
    parse_prompts,
    parse_sampling,
)
from moeserve.services.http.server import HttpServer
from moeserve.services.http.tokens import TokenRoutes
from moeserve.services.http.tools import Tools, ToolStream, parse_tools, template_messages
from moeserve.services.limits import MAX_CHOICES, MAX_LOGPROBS, MAX_N, request_budget, request_cost
from moeserve.services.tokenizer import Detokenizer, StopStrings
from moeserve.version import __version__

if TYPE_CHECKING:
    from moeserve.router.engine.api import GenerateRequest
    from moeserve.services.readiness import Readiness

log = logging.getLogger("moeserve.services.http")


async def _until_disconnect(receive, coro):
    """Run ``coro``; when the client goes away first, cancel it (its requests are cancelled)."""
    from starlette.responses import Response

    work = asyncio.ensure_future(coro)
    gone = asyncio.ensure_future(disconnected(receive))
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


def _parse_body(raw: bytes, budget: int) -> dict:
    """The body as a JSON object, counted against the request's budget (``limits.request_cost``)
    before anything else reads it."""
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    request_cost(body, budget)
    return body


def trim_memory() -> None:
    """Hand the heap's free memory back to the system (glibc's malloc_trim): a large body's
    objects are freed at once, but malloc keeps their pages, and a front end that refused many
    large requests would keep their peak as its resident size."""
    global _TRIM
    if _TRIM is None:
        import ctypes

        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None  # libc's malloc_trim, or False where there is none


class HttpApi(TokenRoutes):
    """The ASGI application (``app``) and its state.

    admission: the front end's shared admission path; served_models: the names a request's
    ``model`` may take (the first is the default); model_root: the model folder (shown by
    /v1/models); api_key: guards ``/v1/`` (None: open); registry: the Prometheus registry of
    /metrics (None: an empty answer); max_body_bytes: the largest request body (at most
    :func:`body_limit` of the admission limits); max_logprobs: the most top logprobs a request
    may ask for (``--max-logprobs``; None: the admission limits'); generation_defaults: sampling defaults for what a request
    leaves out (the model's ``generation_config.json``: ``params.GENERATION_DEFAULTS``);
    vllm_metrics: a ``moeserve.ops.metrics.VllmMetrics`` refreshed from the leader's status
    on every scrape of /metrics (None: none).
    """

    def __init__(
        self,
        admission: Admission,
        served_models: list[str],
        model_root: str = "",
        api_key: str | None = None,
        registry=None,
        max_body_bytes: int = MAX_BODY_BYTES,
        max_logprobs: int | None = None,
        generation_defaults: dict | None = None,
        vllm_metrics=None,
        tool_parser: str | None = None,
    ):
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        if not served_models:
            raise ValueError("give at least one served model name")
        self.admission = admission
        self.coalesce = stream_coalescing()  # a chunk carries every token a stream fell behind on
        self.served_models = list(served_models)
        self.model_root = model_root
        self._key = api_key.encode() if api_key else None
        self.registry = registry
        self.max_body_bytes = min(max_body_bytes, body_limit(admission.limits))
        self.draining = False
        self._runs: weakref.WeakSet[Run] = weakref.WeakSet()  # requests in flight (cut_streams ends them)
        self.readiness: Readiness | None = None  # the front end's (None: ask the leader)
        self.created = int(time.time())
        if max_logprobs is not None:
            self.max_logprobs = max_logprobs
        self.defaults = dict(generation_defaults or {})
        self.vllm_metrics = vllm_metrics
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ping", self.health, methods=["GET", "POST"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

        async def http_error(request, exc: HTTPException):
            status = exc.status_code if exc.status_code in ERROR_TYPES else 400
            what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
            return ApiError(
                status, what.get(exc.status_code, str(exc.detail)), code="not_found" if exc.status_code == 404 else None
            ).response()

        async def server_error(request, exc: Exception):
            return api_error(exc).response()

        # (Starlette types a handler's exception as Exception, whatever class it is registered for)
        handlers: dict[Any, Callable[..., Any]] = {HTTPException: http_error, Exception: server_error}
        self.app = Starlette(routes=routes, exception_handlers=handlers)

    # -- plumbing -----------------------------------------------------------------------------

    def _auth(self, request) -> None:
        if self._key is None:
            return
        auth = request.headers.get("authorization")
        if auth is None:
            raise ApiError(
                401,
                "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )
        scheme, _, key = auth.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "the Authorization header must read 'Bearer <key>'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self._key):
            raise ApiError(401, "wrong API key", code="invalid_api_key")

    @property
    def max_logprobs(self) -> int:
        """The most top logprobs a request may ask for (``--max-logprobs``), kept in the
        admission limits, which bound every request field (``limits.BOUNDS``)."""
        return self.admission.limits.max_logprobs

    @max_logprobs.setter
    def max_logprobs(self, value: int) -> None:
        self.admission.limits = dataclasses.replace(self.admission.limits, max_logprobs=value)

    def cut_streams(self, message: str) -> None:
        """End every request in flight with ``message`` (503): a stream sends it as an error
        event, then ``data: [DONE]`` (the server stops once its grace period is over)."""
        for run in list(self._runs):
            run.cut(Unavailable(message))

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
        del chunks
        budget = request_budget(self.admission.limits)
        try:  # a large body is parsed (and counted) off the event loop
            if len(raw) < PARSE_OFF_LOOP_BYTES:
                return _parse_body(raw, budget)
            try:
                return await asyncio.to_thread(_parse_body, raw, budget)
            finally:
                del raw
                trim_memory()  # what the parse took goes back to the system
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise bad(f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise bad("the request body nests too deeply") from None

    async def _generation(self, request, handler):
        try:
            if self.draining:
                raise ApiError(503, "the server is shutting down", code="unavailable")
            self._auth(request)
            body = await self._body(request)
        except Exception as e:
            return api_error(e).response()
        try:
            return await _until_disconnect(request.receive, handler(body))
        except Exception as e:
            return api_error(e).response()

    # -- routes -------------------------------------------------------------------------------

    async def completions(self, request):
        return await self._generation(request, self._completions)

    async def chat_completions(self, request):
        return await self._generation(request, self._chat)

    def _model_card(self, m: str) -> dict:
        return {
            "id": m,
            "object": "model",
            "created": self.created,
            "owned_by": "moeserve",
            "root": self.model_root or m,
            "parent": None,
            "max_model_len": self.admission.limits.max_model_len,
        }

    async def models(self, request):
        try:
            self._auth(request)
        except ApiError as e:
            return e.response()
        return json_response({"object": "list", "data": [self._model_card(m) for m in self.served_models]})

    async def model(self, request):
        """GET /v1/models/{id}: one served model, or 404 naming those served."""
        try:
            self._auth(request)
            name = request.path_params["model_id"]
            return json_response(self._model_card(parse_model({"model": name}, self.served_models)))
        except ApiError as e:
            return e.response()

    def _ignored(self, unknown: list[str], route: str) -> None:
        if unknown:
            log.warning("%s: the request has fields moeserve ignores: %s", route, ", ".join(unknown))

    async def health(self, request):
        if self.draining:
            return ApiError(503, "the server is shutting down", code="unavailable").response()
        r = self.readiness
        if r is not None:
            if not r.ready:
                return ApiError(
                    503, f"the cluster cannot take a request ({r.reason}): {r.detail}", code="unavailable"
                ).response()
            return json_response({"status": "ok"})
        call = getattr(self.admission.engine, "call", None)
        if call is not None:
            try:
                await asyncio.wait_for(call("status"), 5.0)
            except Exception as e:
                return ApiError(503, f"the cluster is unavailable: {e}", code="unavailable").response()
        return json_response({"status": "ok"})

    async def version(self, request):
        return json_response({"version": __version__})

    async def metrics(self, request):
        from starlette.responses import Response

        if self.registry is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        from prometheus_client import generate_latest

        from moeserve.ops.metrics import TEXT_FORMAT

        if self.vllm_metrics is not None:
            await self.vllm_metrics.refresh(self.admission.engine)

        return Response(generate_latest(self.registry), media_type=TEXT_FORMAT)

    # -- generation ---------------------------------------------------------------------------

    def _requests(self, prompts, s: Sampling, texts: dict | None = None):
        """One engine request and one Choice per (prompt, j < n); ``texts``: prompt ids -> the
        text they were tokenized from (echo shows it as given)."""
        a = self.admission
        if len(prompts) * s.n > MAX_CHOICES:
            raise bad(
                f"{len(prompts)} prompts x n = {s.n} make {len(prompts) * s.n} choices; at most {MAX_CHOICES}", "n"
            )
        lens = [len(ids) + (s.max_tokens if s.max_tokens is not None else a.limits.max_model_len) for ids in prompts]
        held = s.n * sum(min(n, a.limits.max_model_len) for n in lens)
        if held > a.limits.request_tokens:
            raise bad(
                f"this request asks the cluster to hold {held} tokens (n = {s.n} x the prompts' tokens plus "
                f"max_tokens); one request may hold at most {a.limits.request_tokens} (--max-request-tokens)",
                "n" if s.n > 1 else "max_tokens",
            )
        reqs: list[GenerateRequest] = []
        choices: list[Choice] = []
        for ids in prompts:
            max_tokens = s.max_tokens if s.max_tokens is not None else max(1, a.limits.max_model_len - len(ids))
            for j in range(s.n):
                seed = s.seed + j if s.seed is not None else None
                reqs.append(
                    a.request(
                        ids,
                        max_tokens,
                        temperature=s.temperature,
                        top_p=s.top_p,
                        top_k=s.top_k,
                        seed=seed,
                        stop_token_ids=s.stop_token_ids,
                        ignore_eos=s.ignore_eos,
                        return_logits="last" if s.logprobs is not None else "",
                        prompt_logprobs=s.prompt_top,
                        min_p=s.min_p,
                        presence_penalty=s.presence_penalty,
                        frequency_penalty=s.frequency_penalty,
                        repetition_penalty=s.repetition_penalty,
                        min_tokens=s.min_tokens,
                        logit_bias=s.logit_bias,
                        cache_salt=s.cache_salt,
                        grammar=s.grammar,
                    )
                )
                choice = Choice(
                    len(choices),
                    Detokenizer(a.tokenizer, s.skip_special_tokens),
                    StopStrings(s.stops),
                    frozenset(s.stop_token_ids),
                    s.logprobs,
                    s.include_stop_str,
                    ids,
                    min_tokens=s.min_tokens,
                )
                if s.echo:  # a text prompt as given, ids as they decode
                    given = (texts or {}).get(ids)
                    choice.echo = (
                        given if given is not None else Detokenizer.of(a.tokenizer, ids, s.skip_special_tokens)
                    )
                choices.append(choice)
        if s.stops and a.tokenizer is None:
            raise bad("stop strings need the model's tokenizer (this server has none): use stop_token_ids", "stop")
        return reqs, choices

    async def _completions(self, body: dict):
        self._ignored(check_keys(body, COMPLETION_KEYS), "/v1/completions")
        model = parse_model(body, self.served_models)
        s = parse_sampling(body, False, self.admission.limits, self.defaults)
        prompts = await parse_prompts(body, self.admission)
        texts = None
        if s.echo:  # echo shows a text prompt as it was given
            raw = body.get("prompt")
            given: list = [raw] if isinstance(raw, str) else list(raw) if isinstance(raw, list) else []
            texts = {ids: g for ids, g in zip(prompts, given) if isinstance(g, str)}
        return await self._respond(model, prompts, s, chat=False, texts=texts)

    async def _chat(self, body: dict):
        self._ignored(check_keys(body, CHAT_KEYS), "/v1/chat/completions")
        model = parse_model(body, self.served_models)
        s = parse_sampling(body, True, self.admission.limits, self.defaults)
        messages = parse_messages(body)
        add_gen, kwargs = parse_chat_options(body)
        tools = parse_tools(body, self.tool_parser)
        if tools is not None and tools.constrained:
            if s.grammar is not None:
                raise bad(
                    f"tool_choice {tools.choice} constrains the output already: leave out response_format",
                    "tool_choice",
                )
            s = dataclasses.replace(s, grammar=tools.grammar())
        ids = await self.admission.chat_ids(
            template_messages(messages), add_gen, kwargs, list(tools.tools) if tools is not None else None
        )
        return await self._respond(model, [ids], s, chat=True, tools=tools)

    async def _respond(
        self, model: str, prompts, s: Sampling, chat: bool, texts: dict | None = None, tools: Tools | None = None
    ):
        reqs, choices = self._requests(prompts, s, texts)
        if s.grammar is not None:  # before anything reaches the leader: a bad grammar is a 400
            await self.admission.check_grammar(s.grammar)
        prompt_tokens = sum(len(p) for p in prompts)
        rid = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        created = int(time.time())
        lim = self.admission.limits
        heavy = s.logprobs is not None or s.prompt_top >= 0  # logits sent back for every token or position
        share = max(1, lim.choices_in_flight // 4) if heavy else lim.choices_in_flight
        run = Run(self.admission, reqs, share)
        self._runs.add(run)
        try:
            if s.stream:
                await run.prime()
                return EventStream(
                    self._chunks(run, choices, rid, created, model, prompt_tokens, s, chat, tools),
                    {"x-request-id": rid},
                )
            async for _ in drive(run, choices):
                pass
        except BaseException:
            await run.close()
            raise
        await run.close()
        tok = self.admission.tokenizer
        out = []
        for c in choices:
            part: dict = {"index": c.index}
            finish = c.finish_reason
            if chat:
                part["message"] = {"role": "assistant", "content": c.text}
                if tools is not None and tools.parses:
                    content, calls = tools.read(c.text)
                    part["message"] = {
                        "role": "assistant",
                        "content": content,
                        "tool_calls": [call.part(i) for i, call in enumerate(calls)],
                    }
                    finish = "tool_calls" if calls else finish
            else:
                part["text"] = (c.echo or "") + c.text
            part.update(
                logprobs=logprobs_part(tok, c.logprobs, chat) if s.logprobs is not None else None,
                finish_reason=finish,
                stop_reason=c.stop_reason,
            )
            if s.prompt_logprobs is not None and not chat:
                part["prompt_logprobs"] = self._prompt_lp(c, s)
            if s.return_token_ids:
                if not chat:
                    part["prompt_token_ids"] = list(c.prompt_ids)
                part["token_ids"] = list(c.token_ids)
            out.append(part)
        body: dict = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": out,
            "usage": usage(prompt_tokens, choices, s.n),
        }
        if chat and s.return_token_ids:
            body["prompt_token_ids"] = list(prompts[0])
        if chat and s.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_lp(choices[0], s)
        return json_response(body, headers={"x-request-id": rid})

    def _prompt_lp(self, c: Choice, s: Sampling) -> list | None:
        if c.prompt_lp is None:
            return None
        return prompt_logprobs_part(self.admission.tokenizer, c.prompt_ids, c.prompt_lp, s.prompt_logprobs or 0)

    async def _chunks(
        self, run: Run, choices, rid, created, model, prompt_tokens, s: Sampling, chat: bool, tools: Tools | None = None
    ):
        kind = "chat.completion.chunk" if chat else "text_completion"
        extra: dict = {"usage": None} if s.include_usage else {}
        if s.continuous_usage:  # every chunk carries the usage so far
            extra["usage"] = usage(prompt_tokens, choices)
        tok = self.admission.tokenizer
        # A chunk per token, even one whose text is held back (or empty: no tokenizer), when the
        # client asked for the ids or has no text to see tokens arrive by.
        every_token = s.return_token_ids or tok is None
        prompt_ids = {"prompt_token_ids": list(choices[0].prompt_ids)} if chat and s.return_token_ids else {}

        def chunk(parts):
            nonlocal prompt_ids
            out = sse(
                {"id": rid, "object": kind, "created": created, "model": model, "choices": parts, **extra, **prompt_ids}
            )
            prompt_ids = {}  # chat: the prompt's ids in the first chunk only
            return out

        streams = {c.index: ToolStream(tools) for c in choices} if chat and tools is not None and tools.parses else {}
        try:
            if chat:
                for c in choices:
                    part = {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    if s.return_token_ids:
                        part["token_ids"] = []
                    yield chunk([part])
            async for c, text, entries in drive(run, choices, self.coalesce):
                if c.echo is not None and not c.echo_sent:
                    text, c.echo_sent = c.echo + text, True
                if not text and not entries and not c.done and not every_token:
                    continue
                lp = logprobs_part(tok, entries, chat) if s.logprobs is not None else None
                part = {"index": c.index, "logprobs": lp, "finish_reason": c.finish_reason if c.done else None}
                if c.done:
                    part["stop_reason"] = c.stop_reason
                if chat:
                    delta: dict = {}
                    if c.index in streams:  # held back while it may be a tool call
                        text = streams[c.index].feed(text)
                        if c.done:
                            rest, calls = streams[c.index].finish()
                            text += rest
                            if calls:
                                delta["tool_calls"] = [call.part(i) for i, call in enumerate(calls)]
                                part["finish_reason"] = "tool_calls"
                    if text:
                        delta["content"] = text
                    if not delta and not c.done and not entries and not every_token:
                        continue
                    part["delta"] = delta
                else:
                    part["text"] = text
                    if s.prompt_logprobs is not None and c.prompt_lp is not None and not c.plp_sent:
                        part["prompt_logprobs"] = self._prompt_lp(c, s)
                        c.plp_sent = True
                if s.continuous_usage:
                    extra["usage"] = usage(prompt_tokens, choices)
                if s.return_token_ids:
                    if not chat and not c.prompt_sent:
                        part["prompt_token_ids"] = list(c.prompt_ids)
                        c.prompt_sent = True
                    part["token_ids"] = c.new_ids()
                yield chunk([part])
            if s.include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": kind,
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(prompt_tokens, choices, s.n),
                    }
                )
        except Exception as e:
            yield sse(api_error(e).body())
        finally:
            await run.close()
        yield SSE_DONE


# What callers import from here (the app, the server, the errors) and, for imports written
# before the split, the public names of the modules it was split into.
__all__ = [
    "HttpApi",
    "HttpServer",
    "ApiError",
    "api_error",
    "bad",
    "log_softmax_row",
    "body_limit",
    "Choice",
    "Run",
    "drive",
    "FINISH",
    "EventStream",
    "ERROR_TYPES",
    "SSE_HEADERS",
    "Sampling",
    "parse_sampling",
    "parse_messages",
    "check_keys",
    "UNSUPPORTED",
    "IGNORED",
    "COMMON",
    "COMPLETION_KEYS",
    "CHAT_KEYS",
    "CHAT_ROLES",
    "MAX_N",
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "MAX_BODY_BYTES",
    "PARSE_OFF_LOOP_BYTES",
    "DEFAULT_COMPLETION_TOKENS",
]
