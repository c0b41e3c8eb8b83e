"""The serving front end (``moeserve.v1.Serving``): a process of its own in front of the leader.

It turns gRPC requests into :class:`~moeserve.router.engine.api.GenerateRequest` s and streams
them to the leader over the local channel (:class:`~moeserve.router.engine.channel.AsyncEngineClient`):
one connection per request on this process's event loop, no thread per request, so the step
loop never waits for it and it never waits for a step. Text prompts are tokenized here and
generated ids detokenized when the model folder has ``tokenizer.json``.

Validation: this side checks only what the leader cannot (text, which fields are set, the
sampling values a ``SamplingParams`` accepts); the leader's engine validates the request once,
as it admits it. Errors go through the one table of ``moeserve.services.errors``: bad input ->
INVALID_ARGUMENT, a full admission queue -> RESOURCE_EXHAUSTED, the leader gone or stopping ->
UNAVAILABLE. A call that is cancelled or passes its deadline closes its connection, which
cancels its request on the leader.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from moeserve.router.engine.api import Failed, Finished, GenerateRequest, InvalidRequest, Token
from moeserve.router.engine.channel import AsyncEngineClient
from moeserve.rpc import serving_pb2, serving_pb2_grpc
from moeserve.sampling import SamplingParams
from moeserve.services.errors import abort_for
from moeserve.services.server import SERVING, ServerOptions, ServiceServer
from moeserve.wire import FINISH_REASONS

DEFAULT_MAX_TOKENS = 16


def load_tokenizer(model_dir: str | None):
    """The model folder's tokenizer.json, or None."""
    if not model_dir:
        return None
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path))


class ServingService(serving_pb2_grpc.ServingServicer):
    """``engine``: an AsyncEngineClient to the leader; ``tokenizer``: a tokenizers.Tokenizer or
    None; ``metrics``: a moeserve.metrics.FrontendMetrics (request latencies and tokens) or None."""

    def __init__(self, engine: AsyncEngineClient, tokenizer=None, metrics=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics

    def to_request(self, r: serving_pb2.GenerateRequest) -> GenerateRequest:
        """The request in token ids; InvalidRequest for what only this side can check (the text,
        which fields are set, sampling values). The leader validates the rest, once."""
        if r.prompt and r.prompt_token_ids:
            raise InvalidRequest("give either prompt (text) or prompt_token_ids, not both")
        if r.prompt:
            if self.tokenizer is None:
                raise InvalidRequest("this server has no tokenizer (no tokenizer.json in the model folder): "
                                     "send prompt_token_ids instead of prompt text")
            ids = tuple(self.tokenizer.encode(r.prompt).ids)
            if not ids:
                raise InvalidRequest("the prompt text encodes to no tokens: give a non-empty prompt")
        else:
            ids = tuple(int(t) for t in r.prompt_token_ids)
        max_tokens = r.max_tokens if r.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        try:
            sp = SamplingParams(temperature=float(r.temperature), top_p=r.top_p if r.HasField("top_p") else 1.0,
                                top_k=int(r.top_k), seed=int(r.seed) if r.HasField("seed") else None)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return GenerateRequest(ids, int(max_tokens), sp, tuple(int(t) for t in r.stop_token_ids), bool(r.ignore_eos))

    def _text(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    async def _events(self, req: GenerateRequest, context):
        """Async iterator of the request's events from the leader, ending the call with the
        right status when the leader refuses it or fails."""
        record = self.metrics.request(len(req.prompt_ids)) if self.metrics is not None else None
        reason = "error"
        stream = self.engine.generate([req])
        try:
            try:
                async for _, ev in stream:
                    if isinstance(ev, Failed):
                        await context.abort(grpc.StatusCode.UNAVAILABLE, ev.message)
                    if isinstance(ev, Token):
                        if record is not None:
                            record.token()
                    elif isinstance(ev, Finished):
                        reason = str(ev.reason)
                    yield ev
            except Exception as e:
                if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                    raise
                await abort_for(context, e)
        except (asyncio.CancelledError, GeneratorExit):  # the client went away or its deadline passed
            reason = "cancelled"
            raise
        finally:                                      # closing the stream closes its connection: cancels
            await stream.aclose()
            if record is not None:
                record.finish(reason)

    async def Generate(self, request, context):
        try:
            req = self.to_request(request)
        except InvalidRequest as e:
            await abort_for(context, e)
        tokens, reason = [], ""
        async for ev in self._events(req, context):
            if isinstance(ev, Token):
                tokens.append(ev.token_id)
            elif isinstance(ev, Finished):
                reason = str(ev.reason)
        return serving_pb2.GenerateResponse(
            token_ids=tokens, text=self._text(tokens), finish_reason=FINISH_REASONS.get(reason, 0),
            usage=serving_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens)))

    async def GenerateStream(self, request, context):
        try:
            req = self.to_request(request)
        except InvalidRequest as e:
            await abort_for(context, e)
        tokens: list[int] = []
        sent = ""
        pending: list[int] = []
        async for ev in self._events(req, context):
            if isinstance(ev, Token):
                tokens.append(ev.token_id)
                pending.append(ev.token_id)
                text = self._text(tokens)
                delta = ""
                if not text.endswith("\ufffd"):          # hold back an incomplete character
                    delta, sent = text[len(sent):], text
                yield serving_pb2.GenerateStreamResponse(token_ids=pending, text=delta)
                pending = []
            elif isinstance(ev, Finished):
                text = self._text(tokens)
                yield serving_pb2.GenerateStreamResponse(
                    text=text[len(sent):], finish_reason=FINISH_REASONS.get(str(ev.reason), 0),
                    usage=serving_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens)))


def make_server(engine: AsyncEngineClient, tokenizer, options: ServerOptions, metrics=None) -> ServiceServer:
    service = ServingService(engine, tokenizer, metrics)
    return ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), options)
