"""The HTTP API's client: ``POST /v1/completions`` with ``stream: true`` through httpx (or its
successor httpx2), one connection per stream in flight, every token's arrival time taken from
the server-sent events as they come in (:class:`SseTokens`). httpx is imported here only, by
the HTTP clients' processes: the gRPC command lines need nothing new."""

from __future__ import annotations

import asyncio
import json
import time

from servinglib.streams import run_plan, start

# The front end's flags in the benchmarks' HTTP runs. The clients open their connections in the
# warm-up and keep them idle until every client process is ready: with the server's 5 s
# keep-alive a connection closed by the server while a request goes out on it is a stream lost
# to the race of the two (httpx: ReadError), not to the server (1024 streams on 2 cores lost
# 7-12 of them).
SERVER_FLAGS = ("--timeout-keep-alive", "600")


def http_module():
    """The async HTTP client's module, imported here only (the HTTP clients' processes): httpx,
    or httpx2 (its successor, with the same API), whichever is installed."""
    try:
        import httpx
    except ImportError:
        try:
            import httpx2 as httpx
        except ImportError:
            raise ImportError(
                "--apis http needs httpx (pip install httpx; on a machine without a package "
                "registry, bring its wheels: pip download httpx)"
            ) from None
    return httpx


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status, self.body = status, body


class SseTokens:
    """The server-sent events of one streamed completion, fed as bytes arrive: :meth:`feed`
    answers how many new tokens they carry. A chunk's tokens: its ``token_ids`` when the server
    sends them, else its ``logprobs.tokens``, else one for a chunk with text and no
    finish_reason (the last chunk may carry text a finished detokenizer flushed, or a stop
    string's token: :meth:`missing` gets those from ``usage.completion_tokens``)."""

    def __init__(self):
        self.buf = b""
        self.counted = 0
        self.usage_tokens: int | None = None
        self.finish: str | None = None
        self.error: str | None = None
        self.done = False
        self.chunks = 0
        self.token_ids = False
        self.cached = 0  # usage.prompt_tokens_details.cached_tokens

    def feed(self, data: bytes) -> int:
        self.buf += data
        new = 0
        while True:
            end = self.buf.find(b"\n\n")
            if end < 0:
                break
            event, self.buf = self.buf[:end], self.buf[end + 2 :]
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                else:
                    new += self._chunk(json.loads(payload))
        self.counted += new
        return new

    def _chunk(self, obj: dict) -> int:
        if "error" in obj:
            err = obj["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return 0
        self.chunks += 1
        usage = obj.get("usage")
        if usage:
            self.usage_tokens = usage.get("completion_tokens")
            self.cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        n = 0
        for ch in obj.get("choices") or ():
            ids = ch.get("token_ids")
            if ids is not None:
                self.token_ids = True
                n += len(ids)
            elif ch.get("finish_reason") is None:
                lp = ch.get("logprobs")
                n += len(lp.get("tokens") or ()) if lp else (1 if ch.get("text") else 0)
            if ch.get("finish_reason") is not None:
                self.finish = ch["finish_reason"]
        return n

    def missing(self) -> int:
        """Tokens the usage counts that no chunk showed (0 when every chunk showed its tokens)."""
        return max(0, (self.usage_tokens or 0) - self.counted)


async def client_http(base, plan, t0_value, go, results, warm, deadline_s, salt="") -> None:
    """Streamed completions at ``base`` (http://HOST:PORT), every request of ``plan`` at its
    offset from the common start, with ``salt`` as their ``cache_salt`` when set; the warm-up
    opens a connection per stream in flight."""
    httpx = http_module()
    client = httpx.AsyncClient(
        base_url=base,
        trust_env=False,
        timeout=httpx.Timeout(deadline_s, connect=60.0, pool=deadline_s),
        limits=httpx.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=max(60.0, deadline_s)
        ),
    )
    extra = {"return_token_ids": True}

    async def stream(prompt, n, on_tokens) -> SseTokens:
        body = {
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **extra,
            **({"cache_salt": salt} if salt else {}),
        }
        sse = SseTokens()
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                raise HttpStatusError(resp.status_code, (await resp.aread()).decode(errors="replace"))
            async for data in resp.aiter_raw():
                now = time.monotonic()
                k = sse.feed(data)
                if k:
                    on_tokens(now, k)
        if sse.error:
            raise RuntimeError(f"the stream ended with an error: {sse.error}")
        if not sse.done:
            raise RuntimeError("the stream ended without data: [DONE]")
        return sse

    if warm:
        try:  # does the server send each chunk's token ids?
            await stream([5, 6, 7], 1, lambda *_: None)
        except HttpStatusError as e:
            if e.status != 400 or "return_token_ids" not in e.body:
                raise
            extra = {}
        # one connection per stream this process will have in flight (at most 256), kept alive
        await asyncio.gather(*(stream([5, 6, 7], 1, lambda *_: None) for _ in range(min(len(plan), 256))))
    results.put(("ready", None))
    t0 = await start(go, t0_value)

    async def request(rec, prompt, n):
        def on_tokens(now, k):
            rec["tokens"].extend([now - t0] * k)

        sse = await stream(prompt, n, on_tokens)
        rec["finish"] = sse.finish
        rec["cached"] = sse.cached
        k = sse.missing()
        if k:
            rec["tokens"].extend([rec["tokens"][-1] if rec["tokens"] else time.monotonic() - t0] * k)
            rec["from_usage"] = k

    recs, cpu = await run_plan(plan, t0, deadline_s, request, {"from_usage": 0, "cached": 0})
    await client.aclose()
    results.put(("done", {"recs": recs, "cpu_s": cpu, "token_ids": bool(extra)}))
