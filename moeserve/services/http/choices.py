"""The generation state of one HTTP request of the OpenAI-compatible API
(``moeserve.services.http``): a :class:`Choice` per choice (its text so far, cut by stop
strings matched across token boundaries; its token ids; its logprobs, the log-softmax of the
logits the engine returns with each token), the :class:`Run` of the request streams of all
choices (cancelled on the leader when it closes) and :func:`drive`, which feeds events to
choices until every one is done.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import numpy as np

from moeserve.router.engine.api import Finished, FinishReason, FirstToken, Token, Unavailable
from moeserve.services.admission import Admission
from moeserve.services.tokenizer import Detokenizer, StopStrings

FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort"}


def log_softmax_row(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = x.max()
    return x - (m + math.log(np.exp(x - m).sum()))


@dataclass
class Choice:
    """One choice's state: its text so far (stop strings cut it), its tokens and logprobs.
    ``token_ids``: every id generated (the one that completed a stop string included, as
    ``usage`` counts it); :meth:`new_ids` hands out those not yet sent in a chunk."""

    index: int
    detok: Detokenizer
    stops: StopStrings
    stop_ids: frozenset
    top_n: int | None
    include_stop: bool
    prompt_ids: tuple = ()
    tokens: int = 0
    text: str = ""
    done: bool = False
    finish_reason: str | None = None
    stop_reason: object = None
    last_token: int | None = None
    logprobs: list = field(default_factory=list)  # (token id, logprob, [(id, logprob)], text offset)
    ids_sent: int = 0  # token ids already sent in chunks
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (the first token says)
    prompt_sent: bool = False  # a chunk already carried prompt_token_ids
    min_tokens: int = 0  # stop strings count from this many tokens on (vLLM's min_tokens)
    echo: str | None = None  # echo: the prompt's text, before the generated text
    echo_sent: bool = False  # a chunk already carried it
    prompt_lp: object = None  # the PromptLogprobs of the prompt (with the first token)
    plp_sent: bool = False  # a chunk already carried prompt_logprobs

    @property
    def token_ids(self) -> list[int]:
        return self.detok.ids

    def new_ids(self) -> list[int]:
        """The ids generated since the last call (for the next chunk)."""
        ids = self.detok.ids[self.ids_sent :]
        self.ids_sent = len(self.detok.ids)
        return ids

    def on_token(self, ev: Token) -> tuple[str, list]:
        self.tokens += 1
        if isinstance(ev, FirstToken):
            self.cached_tokens = ev.cached_tokens
        self.last_token = ev.token_id
        entries = []
        if ev.prompt_logprobs is not None:
            self.prompt_lp = ev.prompt_logprobs
            if self.echo is not None and self.top_n is not None:
                entries.extend(self._prompt_entries(ev.prompt_logprobs))
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
            base = len(self.echo or "")
            entries.append((ev.token_id, float(lp[ev.token_id]), top, base + len(self.detok.text)))
            self.logprobs.extend(entries)
        self.detok.add(ev.token_id)
        out, stopped = self.stops.feed(self.detok.text, match=self.tokens >= self.min_tokens)
        if stopped:
            self._stop(out)
            out = out + ((self.stops.matched or "") if self.include_stop else "")  # (matched: set when stopped)
        self.text += out
        return out, entries

    def _stop(self, out: str) -> None:
        self.done = True
        self.finish_reason = "stop"
        self.stop_reason = self.stops.matched

    def _prompt_entries(self, plp) -> list:
        """echo's logprobs of the prompt: (id, logprob, [(id, logprob)], text offset) per prompt
        token, the first without a logprob (nothing comes before it)."""
        text = Detokenizer(self.detok.tok, self.detok.skip)  # offsets into the prompt's text as echoed
        out: list[tuple] = []
        k = self.top_n or 0
        for i, t in enumerate(self.prompt_ids):
            off = len(text.text)
            if i == 0:
                out.append((t, None, None, off))
            else:
                top = [(int(a), float(b)) for a, b in zip(plp.top_ids[i - 1][:k], plp.top_logprobs[i - 1][:k])]
                out.append((t, float(plp.logprob[i - 1]), top, off))
            text.add(t)
        return out

    def on_finish(self, reason) -> str:
        self.detok.flush()
        out, stopped = self.stops.feed(self.detok.text, final=True, match=self.tokens >= self.min_tokens)
        self.done = True
        if stopped:
            self._stop(out)
            out = out + ((self.stops.matched or "") if self.include_stop else "")  # (matched: set when stopped)
        else:
            self.finish_reason = FINISH.get(reason, str(reason))
            if reason == FinishReason.STOP and self.last_token in self.stop_ids:
                self.stop_reason = self.last_token
        self.text += out
        return out


class Run:
    """The request streams of one HTTP request's choices, each iterated by a task of its own
    into one queue. At most ``share`` choices are on the leader at a time (the request's share
    of the batch): the next starts as one ends, so a request of many choices cannot fill the
    leader's queue ahead of other requests. Closing it (or a choice) cancels the requests on
    the leader; :meth:`cut` ends it with an error."""

    def __init__(self, admission: Admission, reqs, share: int | None = None):
        self.admission = admission
        self.reqs = list(reqs)
        self.share = max(1, share or len(self.reqs))
        self.streams: list = [None] * len(self.reqs)
        self.tasks: list = [None] * len(self.reqs)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.buffer: list = []
        self.started = 0
        self.closed = False
        for _ in range(min(self.share, len(self.reqs))):
            self._start_next()

    def _start_next(self) -> None:
        if self.closed or self.started >= len(self.reqs):
            return
        i = self.started
        self.started += 1
        self.streams[i] = self.admission.open(self.reqs[i])
        self.tasks[i] = asyncio.ensure_future(self._pump(i, self.streams[i]))

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
            self._start_next()  # its place in the share goes to the next choice

    async def prime(self) -> None:
        """Wait until every choice started so far has its first event; raise the first refusal
        (choices started later share these ones' parameters, so the leader takes them too)."""
        seen: set[int] = set()  # choice indices
        while len(seen) < min(self.share, len(self.reqs)):
            i, item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            seen.add(i)
            self.buffer.append((i, item))

    async def next(self):
        if self.buffer:
            return self.buffer.pop(0)
        return await self.queue.get()

    def next_nowait(self):
        """The next item if one has arrived, else None."""
        if self.buffer:
            return self.buffer.pop(0)
        return None if self.queue.empty() else self.queue.get_nowait()

    def put_back(self, item) -> None:
        """``item`` (from :meth:`next_nowait`) comes out first again."""
        self.buffer.insert(0, item)

    def end(self, i: int, reason: str) -> None:
        """Choice ``i`` is done (a stop string): cancel its request on the leader."""
        self.streams[i].close_reason = reason
        self.tasks[i].cancel()

    def cut(self, error: BaseException) -> None:
        """End the request now with ``error`` (the server stops): ``drive`` raises it."""
        self.queue.put_nowait((-1, error))

    async def close(self) -> None:
        self.closed = True
        tasks = [t for t in self.tasks if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drive(run: Run, choices: list[Choice], coalesce: bool = False):
    """(choice, new text, new logprob entries) as events arrive, until every choice is done;
    with ``coalesce`` a choice's tokens that have arrived together come as one."""
    left = sum(not c.done for c in choices)
    while left:
        i, item = await run.next()
        if i < 0:  # the request was cut
            raise item
        c = choices[i]
        if c.done:
            continue
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise Unavailable("the leader ended a request without a finish event")
        if isinstance(item, Token):
            text, entries = c.on_token(item)
            # the choice's next tokens that have arrived too go in the same chunk: a front end
            # behind the leader catches up (as the gRPC stream's messages do)
            while coalesce and not c.done and (more := run.next_nowait()) is not None:
                j, nxt = more
                if j != i or not isinstance(nxt, Token):
                    run.put_back(more)
                    break
                t, e = c.on_token(nxt)
                text, entries = text + t, entries + e
            if c.done:
                run.end(i, "stop")
                left -= 1
            yield c, text, entries
        elif isinstance(item, Finished):
            text = c.on_finish(item.reason)
            left -= 1
            yield c, text, []


__all__ = ["Choice", "Run", "drive", "log_softmax_row", "FINISH"]
