"""Continuous batching on the leader: which sequences each router runs in the next step.

Every step, each router decodes one token for each of its running sequences and admits
waiting prompts (whole prompts: no chunked prefill in wave 1) while its limits allow:
``max_num_seqs`` running sequences per router, ``max_num_batched_tokens`` new tokens per
router per step. A new sequence goes to the router with the fewest running sequences and
stays there (its KV cache lives there). Finished and cancelled sequences are released on
their router in the next header.

Requests are validated before they get here (``EngineAPI.submit`` calls
``api.validate_request`` once), so nothing a client sends can make a rank fail in the middle of
a step.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from moeserve.config import Limits
from moeserve.dataplane.protocol import RouterWork, SeqWork
from moeserve.router.engine.api import Event, Failed, Finished, FinishReason, GenerateRequest, QueueFull, Token


@dataclass
class Sequence:
    """A request in flight. ``sink`` receives its events (``api.Token``\*, then one
    ``api.Finished`` or ``api.Failed``) on the step driver's thread; by default they go to
    ``events``, a queue."""

    seq_id: int
    req: GenerateRequest
    eos_ids: frozenset
    sink: Callable[[Event], None] | None = None
    events: "queue.SimpleQueue" = field(default_factory=queue.SimpleQueue)
    router: int = -1
    output: list = field(default_factory=list)
    cached: int = 0                 # tokens in the router's KV cache
    next_tokens: tuple = ()         # what the next step feeds
    cancelled: bool = False
    finished: FinishReason | None = None

    def emit(self, event: Event) -> None:
        (self.sink or self.events.put)(event)


class Scheduler:
    """Thread-safe: ``submit``/``cancel`` from any thread, ``schedule``/``on_results`` from
    the leader's step driver only."""

    def __init__(self, num_routers: int, limits: Limits, eos_ids):
        self.num_routers = num_routers
        self.limits = limits
        self.eos_ids = frozenset(eos_ids)
        self._lock = threading.Lock()
        self._waiting: deque[Sequence] = deque()
        self._running: list[dict[int, Sequence]] = [dict() for _ in range(num_routers)]
        self._release: list[list[int]] = [[] for _ in range(num_routers)]
        self._ids = itertools.count(1)
        self.work_available = threading.Event()

    # -- any thread ------------------------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Callable[[Event], None] | None = None) -> Sequence:
        """Queue a validated request; QueueFull when ``max_waiting`` requests wait already."""
        with self._lock:
            if len(self._waiting) >= self.limits.max_waiting:
                raise QueueFull(f"the admission queue is full ({self.limits.max_waiting} waiting requests); retry later")
            seq = Sequence(next(self._ids), req, frozenset() if req.ignore_eos else self.eos_ids, sink)
            seq.next_tokens = tuple(req.prompt_ids)
            self._waiting.append(seq)
        self.work_available.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self._lock:
            seq.cancelled = True
        self.work_available.set()

    def counts(self) -> dict:
        with self._lock:
            return dict(waiting=len(self._waiting), running=sum(len(r) for r in self._running))

    # -- step driver -----------------------------------------------------------------------

    def schedule(self) -> tuple[RouterWork, ...] | None:
        """The work of every router for the next step, or None when there is nothing to run."""
        with self._lock:
            self._drop_cancelled()
            budget = [self.limits.max_num_batched_tokens] * self.num_routers
            seqs: list[list[SeqWork]] = [[] for _ in range(self.num_routers)]
            for r, running in enumerate(self._running):
                for seq in running.values():
                    if seq.cached > 0:                          # decoding: one token
                        seqs[r].append(SeqWork(seq.seq_id, seq.next_tokens, seq.cached,
                                               return_logits=seq.req.return_logits and "last"))
                        budget[r] -= 1
            while self._waiting:
                seq = self._waiting[0]
                r = int(np.argmin([len(x) for x in self._running]))
                need = len(seq.next_tokens)
                if len(self._running[r]) >= self.limits.max_num_seqs or need > budget[r]:
                    break
                self._waiting.popleft()
                seq.router = r
                self._running[r][seq.seq_id] = seq
                seqs[r].append(SeqWork(seq.seq_id, seq.next_tokens, 0, seq.req.sampling, seq.req.return_logits))
                budget[r] -= need
            release = [tuple(x) for x in self._release]
            self._release = [[] for _ in range(self.num_routers)]
            if not any(seqs) and not any(release):
                return None
            return tuple(RouterWork(tuple(s), rel) for s, rel in zip(seqs, release))

    def on_results(self, work: tuple[RouterWork, ...], tokens: dict[int, int], logits: dict[int, np.ndarray]) -> None:
        """Record the tokens sampled in a step and finish the sequences that are done."""
        with self._lock:
            for r, rw in enumerate(work):
                for sw in rw.seqs:
                    seq = self._running[r].get(sw.seq_id)
                    if seq is None:
                        continue
                    tok = tokens[sw.seq_id]
                    seq.cached = sw.start + len(sw.token_ids)
                    seq.output.append(tok)
                    seq.next_tokens = (tok,)
                    seq.emit(Token(tok, logits.get(sw.seq_id)))
                    reason = None
                    if tok in seq.eos_ids or tok in seq.req.stop_token_ids:
                        reason = FinishReason.STOP
                    elif len(seq.output) >= seq.req.max_tokens:      # admission keeps prompt + max_tokens <= max_model_len
                        reason = FinishReason.LENGTH
                    if reason:
                        self._finish(r, seq, reason)

    def fail_all(self, message: str) -> None:
        """The cluster is going down: every request in flight gets an error event."""
        with self._lock:
            for seq in list(self._waiting):
                seq.emit(Failed(message))
            self._waiting.clear()
            for running in self._running:
                for seq in running.values():
                    seq.emit(Failed(message))
                running.clear()

    def _finish(self, r: int, seq: Sequence, reason: FinishReason) -> None:
        seq.finished = reason
        del self._running[r][seq.seq_id]
        self._release[r].append(seq.seq_id)
        seq.emit(Finished(reason))

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self._waiting if s.cancelled]:
            self._waiting.remove(seq)
            seq.finished = FinishReason.CANCELLED
            seq.emit(Finished(FinishReason.CANCELLED))
        for r, running in enumerate(self._running):
            for seq in [s for s in running.values() if s.cancelled]:
                self._finish(r, seq, FinishReason.CANCELLED)
