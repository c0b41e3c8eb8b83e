"""The leader's grammars (structured output): one id per distinct grammar, announced to every
router once, ready when every router compiled it; a request whose grammar is not ready waits
in the queue without holding back the others (docs/engine.md, "Structured output").

A grammar's text crosses the control group once, in the header that announces it
(``StepHeader.grammars``); the sequences that use it carry its id (``SeqWork.grammar``). Each
router compiles announced grammars in a thread of its own and reports them in its step result
(``RankResult.grammars``: "" when ready, else why not). A grammar nobody uses stays compiled
on the routers among the ``keep_idle`` most recently used (a second request with the same
schema starts at once), the others are dropped (``StepHeader.drop_grammars``). A grammar that
failed on a router fails its waiting requests (``Failed(invalid=True)``: HTTP 400) and is
remembered, so that the same grammar is refused at once the next time.

Thread-safe: ``acquire`` / ``attach`` from any thread (``Engine.submit``), the rest from the
step driver.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict

from moeserve.grammar import COMPILE_TIMEOUT_S, GrammarSpec

KEEP_IDLE = 64  # compiled grammars kept on the routers with no request using them
KEEP_FAILED = 256  # grammars remembered as failed
REPORT_SLACK_S = 10.0  # beyond a router's own compile deadline, before the leader gives up


class GrammarTable:
    """Grammar ids, their state on the routers, and the sequences that use each."""

    def __init__(self, num_routers: int, keep_idle: int = KEEP_IDLE, timeout_s: float = COMPILE_TIMEOUT_S):
        self.num_routers = num_routers
        self.keep_idle = keep_idle
        self.timeout_s = timeout_s + REPORT_SLACK_S
        self._lock = threading.Lock()
        self._ids: dict[tuple, int] = {}
        self._specs: dict[int, GrammarSpec] = {}
        self._users: dict[int, list] = {}  # id -> the sequences that use it (pruned once finished)
        self._joining: dict[int, int] = {}  # id -> acquired, not attached yet (kept from eviction)
        self._reported: dict[int, set[int]] = {}  # id -> ranks that compiled it
        self._announced_at: dict[int, float] = {}  # ids not ready yet -> when announced
        self._idle: OrderedDict[int, None] = OrderedDict()  # ready, unused: the least recent first
        self._failed: OrderedDict[tuple, str] = OrderedDict()
        self._failed_ids: dict[int, tuple] = {}  # failed id -> its key, while the key is remembered
        self._announce: list[tuple[int, GrammarSpec]] = []
        self._drop: list[int] = []
        self._next = itertools.count()
        self.ready_ids: set[int] = set()  # read without the lock by the scheduler (set membership)

    # -- any thread ----------------------------------------------------------------------------

    def acquire(self, spec: GrammarSpec) -> tuple[int, str | None]:
        """The id of ``spec`` (announced to the routers if it is new) and, when the same grammar
        failed before, why. Every acquire is followed by one ``attach`` or ``abandon``."""
        key = spec.key
        with self._lock:
            why = self._failed.get(key)
            if why is not None:
                return -1, why
            gid = self._ids.get(key)
            if gid is None:
                gid = next(self._next)
                self._ids[key] = gid
                self._specs[gid] = spec
                self._users[gid] = []
                self._reported[gid] = set()
                self._announced_at[gid] = time.monotonic()
                self._announce.append((gid, spec))
            self._idle.pop(gid, None)
            self._joining[gid] = self._joining.get(gid, 0) + 1
            return gid, None

    def attach(self, gid: int, seq) -> str | None:
        """``seq`` (queued) uses ``gid``; returns why not when the grammar failed meanwhile (the
        caller fails the sequence)."""
        with self._lock:
            if gid not in self._users:
                return self._failed.get(self._key_of_failed(gid), "the grammar could not be compiled")
            self._joining[gid] -= 1
            self._users[gid].append(seq)
            return None

    def abandon(self, gid: int) -> None:
        """The request of an ``acquire`` was refused after all (the queue was full)."""
        with self._lock:
            if gid in self._joining:
                self._joining[gid] -= 1

    def _key_of_failed(self, gid: int):
        return self._failed_ids.get(gid)

    def ready(self, gid: int) -> bool:
        return gid in self.ready_ids

    # -- step driver ---------------------------------------------------------------------------

    @property
    def compiling(self) -> bool:
        """Some grammar is announced and not ready on every router yet (the leader keeps steps
        coming so that the routers' reports come back)."""
        return bool(self._announced_at or self._announce)

    def header(self) -> tuple[tuple[tuple[int, GrammarSpec], ...], tuple[int, ...]]:
        """What the next header announces and drops. Grammars whose sequences all finished go
        idle; the least recently used beyond ``keep_idle`` are dropped."""
        with self._lock:
            for gid, users in self._users.items():
                if users:
                    users[:] = [s for s in users if s.finished is None]
                if not users and not self._joining.get(gid) and gid in self.ready_ids and gid not in self._idle:
                    self._idle[gid] = None
            while len(self._idle) > self.keep_idle:
                gid, _ = self._idle.popitem(last=False)
                self._forget(gid)
                self._drop.append(gid)
            out = tuple(self._announce), tuple(self._drop)
            self._announce, self._drop = [], []
            return out

    def on_results(self, results) -> list[tuple[int, str]]:
        """Record the routers' reports of a step (its RankResults); returns (id, why) of the
        grammars that failed, whose waiting sequences the caller fails."""
        failed: list[tuple[int, str]] = []
        with self._lock:
            for r in results:
                for gid, why in (r.grammars or {}).items():
                    if gid not in self._reported:
                        continue  # dropped meanwhile
                    if why:
                        failed.append((gid, f"the grammar could not be compiled on router rank {r.rank}: {why}"))
                        continue
                    self._reported[gid].add(r.rank)
                    if len(self._reported[gid]) >= self.num_routers:
                        self.ready_ids.add(gid)
                        self._announced_at.pop(gid, None)
            now = time.monotonic()
            for gid, t in list(self._announced_at.items()):
                if now - t > self.timeout_s and gid not in {g for g, _ in failed}:
                    failed.append((gid, f"the routers did not compile the grammar within {self.timeout_s:.0f} s"))
            for gid, why in failed:
                if gid in self._specs:
                    spec = self._specs[gid]
                    self._failed[spec.key] = why
                    self._failed_ids[gid] = spec.key
                    while len(self._failed) > KEEP_FAILED:
                        key, _ = self._failed.popitem(last=False)
                        self._failed_ids = {g: k for g, k in self._failed_ids.items() if k != key}
                    self._forget(gid)
                    self._drop.append(gid)
        return failed

    def router_joined(self, rank: int) -> None:
        """A router joined the running cluster as config rank ``rank`` (a replacement): it holds
        no grammar. Every grammar the leader knows (in use, idle or compiling) is announced
        again in the next header, where the routers that have it skip it
        (``GrammarBook.update``) and the new one compiles it; until it reports, no waiting
        sequence of that grammar is admitted (a lost router's sequences, recomputed, may land
        on it and start their matchers there). Running sequences go on."""
        with self._lock:
            now = time.monotonic()
            queued = {gid for gid, _ in self._announce}
            for gid, spec in self._specs.items():
                self._reported.setdefault(gid, set()).discard(rank)
                self.ready_ids.discard(gid)
                self._idle.pop(gid, None)  # idle again once ready (``header``)
                self._announced_at[gid] = now
                if gid not in queued:
                    self._announce.append((gid, spec))

    def _forget(self, gid: int) -> None:
        spec = self._specs.pop(gid, None)
        if spec is not None and self._ids.get(spec.key) == gid:
            del self._ids[spec.key]
        for table in (self._users, self._joining, self._reported, self._announced_at, self._idle):
            table.pop(gid, None)
        self.ready_ids.discard(gid)

    def counts(self) -> dict:
        with self._lock:
            return dict(
                grammars=len(self._specs), grammars_idle=len(self._idle), grammars_compiling=len(self._announced_at)
            )


__all__ = ["GrammarTable", "KEEP_IDLE"]
