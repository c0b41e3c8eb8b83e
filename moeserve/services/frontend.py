"""The serving front end (``moeserve.v1.Serving``): a process of its own in front of the leader.

It turns gRPC requests into :class:`~moeserve.router.engine.api.GenerateRequest` s and streams
them to the leader over the local channel (:class:`~moeserve.router.engine.channel.AsyncEngineClient`):
one connection per request on this process's event loop, no thread per request, so the step
loop never waits for it and it never waits for a step. Text prompts are tokenized here and
generated ids detokenized when the model folder has ``tokenizer.json``. The same process can
also serve the OpenAI-compatible HTTP API (``moeserve.services.http``): both go through one
admission path, :class:`moeserve.services.admission.Admission` (limits, tokenization off the
event loop, request building, event streaming with cancellation).

Validation: this side checks only what the leader cannot (text, which fields are set, the
sampling values a ``SamplingParams`` accepts) and the limits that keep a request cheap, before
converting anything: gRPC itself refuses (RESOURCE_EXHAUSTED) a message larger than the largest
valid request (:attr:`AdmissionLimits.max_request_bytes`: a prompt of ``max_model_len`` ids or
of the most characters the front end tokenizes, and ``max_stop_ids`` stop ids; at most
``--max-message-bytes``), so a 50 MB id list costs nothing; a prompt or stop id list over its
limit is INVALID_ARGUMENT. The leader's engine validates the request once, as it admits it.

Streaming: a ``GenerateStream`` message carries every token of the stream that reached this
process since the previous message (``RequestStream.batch``). One message per token costs the
process ~50 us of CPU, so at ~20k tokens/s (1,024 sequences at 50 ms a step) it falls behind the
leader; then each stream's tokens wait in its queue and leave together, and the cost per token
falls until it keeps up. ``$MOESERVE_STREAM_COALESCE=0`` sends one message per token (for
measuring this; ``benchmarks/frontend.py``).

Health: the server's grpc.health follows the cluster's readiness
(``moeserve.services.readiness``, the leader's status over the local channel once a second).

Errors go through the one table of ``moeserve.services.errors``: bad input ->
INVALID_ARGUMENT, a full admission queue -> RESOURCE_EXHAUSTED, the leader gone or stopping ->
UNAVAILABLE. A call that is cancelled or passes its deadline closes its connection, which
cancels its request on the leader. With an API key (``--api-key``) every call but health and
reflection needs ``authorization: Bearer <key>``, compared in constant time.
"""

from __future__ import annotations

import hmac

import grpc

from moeserve.router.engine.api import Finished, FirstToken, GenerateRequest, InvalidRequest, Token
from moeserve.router.engine.channel import AsyncEngineClient
from moeserve.rpc import serving_pb2, serving_pb2_grpc
from moeserve.services.admission import Admission, RequestFailed, stream_coalescing
from moeserve.services.errors import abort_for
from moeserve.services.server import SERVING, UNGUARDED, ServerOptions, ServiceServer, _abort_handler
from moeserve.services.tokenizer import Detokenizer, ModelTokenizer
from moeserve.wire import FINISH_REASONS

DEFAULT_MAX_TOKENS = 16
API_KEY_ENV = "MOESERVE_API_KEY"


def load_tokenizer(model_dir: str | None):
    """The model folder's tokenizer (tokenizer.json with its special tokens and chat template), or None."""
    return ModelTokenizer.load(model_dir)


class ApiKeyAuth(grpc.aio.ServerInterceptor):
    """The serving API's key (``--api-key``): every call but health and reflection needs
    ``authorization: Bearer <key>``; the comparison takes constant time."""

    def __init__(self, key: str):
        if not key:
            raise ValueError("the API key must not be empty")
        self._key = key.encode()

    async def intercept_service(self, continuation, details):
        if details.method.startswith(UNGUARDED):
            return await continuation(details)
        auth = dict(details.invocation_metadata or ()).get("authorization")
        if auth is None:
            msg = (
                f"this server needs an API key: send metadata 'authorization: Bearer <key>' "
                f"(the key of --api-key or ${API_KEY_ENV})"
            )
        elif not auth.startswith("Bearer "):
            msg = "the authorization metadata must read 'Bearer <key>'"
        elif not hmac.compare_digest(auth[len("Bearer ") :].encode(), self._key):
            msg = "wrong API key"
        else:
            return await continuation(details)
        return _abort_handler(details.method, grpc.StatusCode.UNAUTHENTICATED, msg)


class ServingService(serving_pb2_grpc.ServingServicer):
    """``engine``: an AsyncEngineClient to the leader; ``tokenizer``: a ModelTokenizer, a
    tokenizers.Tokenizer or None; ``metrics``: a moeserve.ops.metrics.FrontendMetrics (request
    latencies and tokens) or None; ``admission``: the shared admission path (built from the
    other three when not given)."""

    def __init__(
        self, engine: AsyncEngineClient | None = None, tokenizer=None, metrics=None, admission: Admission | None = None
    ):
        self.admission = admission if admission is not None else Admission(engine, tokenizer, metrics)
        self.engine = self.admission.engine
        self.tokenizer = self.admission.tokenizer
        self.metrics = self.admission.metrics
        self.coalesce = stream_coalescing()

    async def to_request(self, r: serving_pb2.GenerateRequest) -> GenerateRequest:
        """The request in token ids; InvalidRequest for what only this side can check (the text,
        which fields are set, sampling values). The leader validates the rest, once."""
        a = self.admission
        if r.prompt and r.prompt_token_ids:
            raise InvalidRequest("give either prompt (text) or prompt_token_ids, not both")
        if r.prompt:
            if a.tokenizer is None:
                raise InvalidRequest(
                    "this server has no tokenizer (no tokenizer.json in the model folder): "
                    "send prompt_token_ids instead of prompt text"
                )
            ids = await a.encode(r.prompt)
        else:
            ids = a.token_ids(r.prompt_token_ids)
        max_tokens = r.max_tokens if r.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        return a.request(
            ids,
            int(max_tokens),
            temperature=float(r.temperature),
            top_p=r.top_p if r.HasField("top_p") else 1.0,
            top_k=int(r.top_k),
            seed=int(r.seed) if r.HasField("seed") else None,
            stop_token_ids=r.stop_token_ids,
            ignore_eos=bool(r.ignore_eos),
            cache_salt=r.cache_salt,
        )

    def _text(self, ids) -> str:
        return self.admission.decode(ids)

    async def _batches(self, req: GenerateRequest, context):
        """Async iterator of the request's events from the leader, a list of those that have
        arrived at a time (``RequestStream.batch``), ending the call with the right status when
        the leader refuses it or fails."""
        stream = self.admission.open(req)
        try:
            try:
                while True:
                    try:
                        evs = await stream.batch()
                    except StopAsyncIteration:
                        return
                    yield evs
            except RequestFailed as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            except Exception as e:
                await abort_for(context, e)
        finally:  # closing the stream closes its connection: cancels
            await stream.aclose()

    async def _admit(self, request, context) -> GenerateRequest:
        try:
            return await self.to_request(request)
        except InvalidRequest as e:
            await abort_for(context, e)

    async def Generate(self, request, context):
        req = await self._admit(request, context)
        tokens, reason, cached = [], "", 0
        async for evs in self._batches(req, context):
            for ev in evs:
                if isinstance(ev, Token):
                    tokens.append(ev.token_id)
                    if isinstance(ev, FirstToken):
                        cached = ev.cached_tokens
                elif isinstance(ev, Finished):
                    reason = str(ev.reason)
        return serving_pb2.GenerateResponse(
            token_ids=tokens,
            text=self._text(tokens),
            finish_reason=FINISH_REASONS.get(reason, serving_pb2.FINISH_REASON_UNSPECIFIED),
            usage=serving_pb2.Usage(
                prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens), cached_tokens=cached
            ),
        )

    async def GenerateStream(self, request, context):
        req = await self._admit(request, context)
        detok = Detokenizer(self.tokenizer)  # incremental: no re-decoding of the whole output
        cached = 0
        async for evs in self._batches(req, context):
            # one message for every token that arrived: a front end behind the leader (a large
            # batch's tokens come faster than one message each can be written) catches up
            ids = [ev.token_id for ev in evs if isinstance(ev, Token)]
            if ids:
                if isinstance(evs[0], FirstToken):
                    cached = evs[0].cached_tokens
                if len(ids) == 1:
                    yield serving_pb2.GenerateStreamResponse(token_ids=ids, text=detok.add(ids[0]))
                elif self.coalesce:
                    text = "".join([detok.add(t) for t in ids])
                    yield serving_pb2.GenerateStreamResponse(token_ids=ids, text=text)
                else:
                    for t in ids:
                        yield serving_pb2.GenerateStreamResponse(token_ids=[t], text=detok.add(t))
            ev = evs[-1]
            if isinstance(ev, Finished):
                yield serving_pb2.GenerateStreamResponse(
                    text=detok.flush(),
                    finish_reason=FINISH_REASONS.get(str(ev.reason), serving_pb2.FINISH_REASON_UNSPECIFIED),
                    usage=serving_pb2.Usage(
                        prompt_tokens=len(req.prompt_ids), completion_tokens=len(detok.ids), cached_tokens=cached
                    ),
                )


def make_server(
    engine: AsyncEngineClient | None,
    tokenizer,
    options: ServerOptions,
    metrics=None,
    admission: Admission | None = None,
    api_key: str | None = None,
    readiness=None,
) -> ServiceServer:
    """The gRPC serving front end; with ``api_key`` every serving call needs it; with
    ``readiness`` (moeserve.services.readiness.Readiness) its health follows the cluster's. It
    receives no message larger than the largest valid request (nor than ``max_message_bytes``)."""
    import dataclasses

    service = ServingService(engine, tokenizer, metrics, admission=admission)
    limit = min(options.max_message_bytes, service.admission.limits.max_request_bytes)
    options = dataclasses.replace(options, max_message_bytes=max(limit, 1024))
    if api_key:
        options = dataclasses.replace(options, interceptors=(*options.interceptors, ApiKeyAuth(api_key)))
    server = ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), options)
    server.readiness = readiness
    return server
