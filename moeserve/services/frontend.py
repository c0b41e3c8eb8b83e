"""The serving front end (``moeserve.v1.Serving``): a process of its own in front of the leader.

It turns gRPC requests into :class:`~moeserve.router.scheduler.GenerateRequest` s and talks to
the leader over the local channel (:mod:`moeserve.cluster.control`), one connection and one
reader thread per request, so the step loop never waits for it and it never waits for a step
on its event loop. Text prompts are tokenized here and generated ids detokenized when the model
folder has ``tokenizer.json``.

Errors: bad input -> INVALID_ARGUMENT (what was wrong and what is allowed; validated here and by
the leader before the request reaches a step), a full admission queue -> RESOURCE_EXHAUSTED,
the leader gone or stopping -> UNAVAILABLE. A call that is cancelled or passes its deadline
cancels its request on the leader.
"""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc

from moeserve.cluster.control import ClusterError, ControlClient, RemoteError
from moeserve.router.scheduler import GenerateRequest, QueueFull
from moeserve.rpc import serving_pb2, serving_pb2_grpc
from moeserve.sampling import MAX_SEED, SamplingParams
from moeserve.services.server import SERVING, ServerOptions, ServiceServer

DEFAULT_MAX_TOKENS = 16
FINISH = {"stop": serving_pb2.STOP, "length": serving_pb2.LENGTH, "cancelled": serving_pb2.CANCELLED}


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
    """``control``: a ControlClient to the leader; ``tokenizer``: a tokenizers.Tokenizer or None;
    ``metrics``: a moeserve.metrics.FrontendMetrics (request latencies and tokens) or None."""

    def __init__(self, control: ControlClient, tokenizer=None, metrics=None):
        self.control = control
        self.tokenizer = tokenizer
        self.metrics = metrics

    def to_request(self, r: serving_pb2.GenerateRequest) -> GenerateRequest:
        """Validate what the leader cannot (text, types, ranges); ValueError says what is wrong."""
        if r.prompt and r.prompt_token_ids:
            raise ValueError("give either prompt (text) or prompt_token_ids, not both")
        if r.prompt:
            if self.tokenizer is None:
                raise ValueError("this server has no tokenizer (no tokenizer.json in the model folder): "
                                 "send prompt_token_ids instead of prompt text")
            ids = tuple(self.tokenizer.encode(r.prompt).ids)
            if not ids:
                raise ValueError("the prompt text encodes to no tokens: give a non-empty prompt")
        else:
            ids = tuple(int(t) for t in r.prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty: give prompt text or at least one prompt token id")
        max_tokens = r.max_tokens if r.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if r.HasField("seed") and not 0 <= r.seed <= MAX_SEED:
            raise ValueError(f"seed must be in 0..{MAX_SEED}, got {r.seed}")
        sp = SamplingParams(temperature=float(r.temperature), top_p=r.top_p if r.HasField("top_p") else 1.0,
                            top_k=int(r.top_k), seed=int(r.seed) if r.HasField("seed") else None)
        return GenerateRequest(ids, int(max_tokens), sp, tuple(int(t) for t in r.stop_token_ids), bool(r.ignore_eos))

    def _text(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    async def _events(self, req: GenerateRequest, context):
        """Async iterator of the request's events from the leader; raising the right status."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        box = {}

        def read():                                   # a thread: blocking reads of the local channel
            try:
                stream = self.control.open_stream([req])
                box["stream"] = stream
                if box.get("cancel"):
                    stream.cancel()
                for _, ev in stream:
                    loop.call_soon_threadsafe(q.put_nowait, ev)
                loop.call_soon_threadsafe(q.put_nowait, ("end",))
            except BaseException as e:                # handed to the handler
                loop.call_soon_threadsafe(q.put_nowait, ("raise", e))
            finally:
                if "stream" in box:
                    box["stream"].close()

        threading.Thread(target=read, name="frontend-stream", daemon=True).start()
        record = self.metrics.request(len(req.prompt_ids)) if self.metrics is not None else None
        reason = "error"
        try:
            while True:
                ev = await q.get()
                if ev[0] == "raise":
                    await _abort_for(context, ev[1])
                if ev[0] == "error":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, ev[1])
                if ev[0] == "end":
                    return
                if record is not None and ev[0] == "token":
                    record.token()
                elif ev[0] == "done":
                    reason = ev[1]
                yield ev
        except (asyncio.CancelledError, GeneratorExit):  # the client went away or its deadline passed
            reason = "cancelled"
            raise
        finally:                                      # done, cancelled, deadline or client gone
            box["cancel"] = True
            if "stream" in box:
                box["stream"].cancel()
            if record is not None:
                record.finish(reason)

    async def Generate(self, request, context):
        try:
            req = self.to_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tokens, reason = [], ""
        async for ev in self._events(req, context):
            if ev[0] == "token":
                tokens.append(ev[1])
            elif ev[0] == "done":
                reason = ev[1]
        return serving_pb2.GenerateResponse(
            token_ids=tokens, text=self._text(tokens), finish_reason=FINISH.get(reason, 0),
            usage=serving_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens)))

    async def GenerateStream(self, request, context):
        try:
            req = self.to_request(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        tokens: list[int] = []
        sent = ""
        pending: list[int] = []
        async for ev in self._events(req, context):
            if ev[0] == "token":
                tokens.append(ev[1])
                pending.append(ev[1])
                text = self._text(tokens)
                delta = ""
                if not text.endswith("\ufffd"):          # hold back an incomplete character
                    delta, sent = text[len(sent):], text
                yield serving_pb2.GenerateStreamResponse(token_ids=pending, text=delta)
                pending = []
            elif ev[0] == "done":
                text = self._text(tokens)
                yield serving_pb2.GenerateStreamResponse(
                    text=text[len(sent):], finish_reason=FINISH.get(ev[1], 0),
                    usage=serving_pb2.Usage(prompt_tokens=len(req.prompt_ids), completion_tokens=len(tokens)))


async def _abort_for(context, e: BaseException):
    if isinstance(e, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    if isinstance(e, QueueFull):
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    if isinstance(e, (ClusterError, RemoteError, RuntimeError, OSError)):
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"the cluster is unavailable: {e}")
    await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")


def make_server(control: ControlClient, tokenizer, options: ServerOptions, metrics=None) -> ServiceServer:
    service = ServingService(control, tokenizer, metrics)
    return ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), options)
