"""Continuous batching on the leader: which sequences each router runs in the next step, and
which KV blocks they hold.

Every step, per router and within its limits (``max_num_seqs`` running sequences,
``max_num_batched_tokens`` new tokens per step): running sequences go first, oldest first
(a decode feeds one token, a prompt longer than the budget continues with its next chunk:
chunked prefill), then waiting prompts are admitted in arrival order while free KV blocks
allow. A new sequence goes to one of the routers that can take it in this step (room under
max_num_seqs, token budget left, free blocks for its first chunk) and stays there (its KV
blocks live there); admission stops when none can. Which one is the routing policy's choice:
``cache_aware`` (the default) takes the router that holds the longest cached prefix of it
among those running at most ``max(1, max_num_seqs // 8)`` sequences more than the least busy
one, then the one with the fewest running sequences; ``round_robin`` takes the next router in
turn. When a running sequence needs a block and none is free, the
newest running sequence of that router is preempted: its blocks are freed and it waits at the
head of the queue, to be recomputed later from its prompt and the tokens it already produced
(its sampling is keyed by (seed, output position), so it produces the same tokens); this is the
one way a sequence is recomputed. Finished,
cancelled and preempted sequences are released on their router in the next header; their
blocks are free at once, since the router applies releases before the step's work.

Prefix caching (``blocks.py``, docs/engine.md): a new or recomputed sequence starts with the
cached blocks of the longest prefix of its known tokens on its router, at most all but its last
token (whose logits it samples from) in whole blocks; its first ``SeqWork`` carries its whole
block table and starts at the cached length. A block is cached (named by its hash) in the
header that completes it, once the leader knows all its tokens: every layer writes a step's
keys and values before any sequence of the step attends, so even a sequence admitted later in
the same step reads it whole. Requests that need every prompt token's logits
(``return_logits == "all"``: echo with logprobs, prompt logprobs) compute their whole prompt.

Asynchronous steps (docs/dataplane.md): the tokens a step samples may come back after the next
step was scheduled. A sequence then counts its token in flight (``pending``): its output
position, ``max_tokens`` and KV blocks include it, and a stop token found late costs one extra
step whose token is dropped. A preempted sequence waits for its token in flight before it is
recomputed with it. A decode never sends its token: once a sequence sampled on its router
(``decoding``), its decodes are ids in ``RouterWork.decodes`` and the router feeds the token
it holds on the device.

Requests are validated before they get here (``EngineAPI.submit`` calls
``api.validate_request`` once), so nothing a client sends can make a rank fail in the middle of
a step.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moeserve.config import ROUTING_POLICIES, Limits
from moeserve.dataplane.protocol import PromptLogprobs, RouterWork, SeqWork
from moeserve.router.engine.api import (
    Event,
    Failed,
    Finished,
    FinishReason,
    FirstToken,
    GenerateRequest,
    HopTimes,
    QueueFull,
    Token,
)
from moeserve.router.engine.blocks import BlockAllocator, blocks_for, extend_hashes, prefix_root

log = logging.getLogger(__name__)

LONG_WAIT_S = 1.0  # a request at the head of the queue this long is logged once, with why


@dataclass
class Sequence:
    """A request in flight. ``sink`` receives its events (``api.Token`` s, then one
    ``api.Finished`` or ``api.Failed``) on the step driver's thread; by default they go to
    ``events``, a queue. ``known`` is the prompt and the tokens generated so far: what the KV
    cache must hold before the next token is sampled; ``cached`` of them are in it (computed,
    or read from the prefix cache). ``hashes``: the hash of every full block of ``known``
    computed so far (``blocks.extend_hashes`` from ``root``); ``hashed``: the leading blocks of
    its table offered to the prefix cache; ``prefix_hit``: the prompt tokens its first admission
    read from the cache (-1 before it)."""

    seq_id: int
    req: GenerateRequest
    eos_ids: frozenset
    sink: Callable[[Event], None] | None = None
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    router: int = -1
    known: list = field(default_factory=list)
    cached: int = 0
    blocks: list = field(default_factory=list)  # the block table on its router
    root: bytes = b""
    hashes: list = field(default_factory=list)
    hashed: int = 0
    prefix_hit: int = -1
    fresh: bool = False  # admitted in the step being scheduled: its SeqWork starts its record
    new_blocks: list = field(default_factory=list)  # blocks it gained in the step being scheduled
    admitted: int = 0  # admission order: the newest is preempted first
    partial_logits: list = field(default_factory=list)  # "all" logits of earlier prefill chunks
    partial_plp: list = field(default_factory=list)  # prompt logprobs of earlier prefill chunks
    pending: int = 0  # tokens sampled in steps whose results are still out
    decoding: bool = False  # its router holds its last sampled token: decodes by id
    cancelled: bool = False
    finished: FinishReason | None = None
    queued_at: float = field(default_factory=time.monotonic)  # when it entered the waiting queue
    arrived_at: float = field(default_factory=time.monotonic)  # when the engine took it (never reset)
    scheduled_at: float | None = None  # its first admission to a router (a preemption keeps it)
    wait_logged: bool = False
    grammar: int = -1  # the id of its grammar (router.engine.grammars), -1: none

    def emit(self, event: Event) -> None:
        (self.sink or self.events.put)(event)

    @property
    def num_output(self) -> int:
        return len(self.known) - len(self.req.prompt_ids)

    @property
    def output(self) -> list[int]:
        """The tokens generated so far (the tail of ``known``)."""
        return self.known[len(self.req.prompt_ids) :]


class Scheduler:
    """Thread-safe: ``submit``/``cancel`` from any thread, ``schedule``/``on_results`` from
    the leader's step driver only. ``num_blocks``: KV blocks of each router (``set_capacity``
    once the routers reported theirs). ``prefix_caching``: share full blocks by the hash of
    their tokens; ``routing``: one of ``ROUTING_POLICIES`` (the module docstring)."""

    def __init__(
        self,
        num_routers: int,
        limits: Limits,
        eos_ids,
        block_size: int = 16,
        num_blocks: int | list[int] = 1 << 20,
        prefix_caching: bool = True,
        routing: str = "cache_aware",
    ):
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"routing policy must be one of {ROUTING_POLICIES}, got {routing!r}")
        self.num_routers = num_routers
        self.limits = limits
        self.eos_ids = frozenset(eos_ids)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.routing = routing
        self._turn = -1  # round_robin: the router that took the last new sequence
        # prompt tokens of first admissions that looked the prefix cache up, and those it held
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._lock = threading.Lock()
        self._waiting: deque[Sequence] = deque()
        self._running: list[dict[int, Sequence]] = [dict() for _ in range(num_routers)]
        self._release: list[list[int]] = [[] for _ in range(num_routers)]
        self._ids = itertools.count(1)
        self._admissions = itertools.count(1)
        self.preemptions = 0
        self.readmitted = 0  # sequences moved off a lost router, to be recomputed on another
        self._open = [True] * num_routers  # routers in the world (a lost one takes no sequence)
        # per scheduled step with sequences, until its results come back: (work, [(sequence, its
        # admission then)] in the order of work's sequences)
        self._issued: deque = deque()
        self.work_available = threading.Event()
        # whether a grammar id is compiled on every router (the engine's GrammarTable): a
        # sequence whose grammar is not waits in the queue without holding back the others
        self.grammar_ready: Callable[[int], bool] = lambda gid: True
        self.set_capacity(num_blocks)

    def set_capacity(self, num_blocks: int | list[int]) -> None:
        """The KV blocks of each router (before any request runs)."""
        per = [num_blocks] * self.num_routers if isinstance(num_blocks, int) else list(num_blocks)
        with self._lock:
            self._blocks = [self.new_allocator(n) for n in per]

    def new_allocator(self, num_blocks: int) -> BlockAllocator:
        """The accounting of a router's ``num_blocks`` KV blocks, all empty (at start, or for a
        router whose pool is new)."""
        return BlockAllocator(num_blocks, self.block_size, caching=self.prefix_caching)

    @property
    def max_kv_tokens(self) -> int:
        """The longest sequence (prompt + max_tokens) any router in the world can hold alone."""
        return min(a.num_blocks for a, up in zip(self._blocks, self._open) if up) * self.block_size

    def router_lost(self, r: int, replay: tuple[RouterWork, ...] | None = None) -> tuple[RouterWork, ...] | None:
        """Router ``r`` left the world with its KV cache: its sequences (running, and those
        preempted from it with a token in flight) go back to the head of the waiting queue, in
        admission order, to be recomputed on the routers left from the tokens known here (as a
        preemption: their sampling is keyed by seed and position, so they produce the same
        tokens again); their tokens in flight never come and are forgotten, and ``r`` takes no
        sequence until :meth:`router_joined`. ``replay``: the work of the failed step to run
        again, which leaves with ``r``'s part emptied (returned; the scheduler expects its
        results under it)."""
        with self._lock:
            self._open[r] = False
            moved = sorted(self._running[r].values(), key=lambda x: x.admitted)
            self._running[r] = {}
            self._release[r] = []
            self._blocks[r] = self.new_allocator(self._blocks[r].num_blocks)  # its pool, and the cache in it, are gone
            gone = {id(x) for x in moved} | {id(x) for x in self._waiting if x.router == r}
            now = time.monotonic()
            for seq in moved:
                seq.blocks, seq.new_blocks, seq.cached, seq.hashed = [], [], 0, 0
                seq.partial_logits, seq.partial_plp, seq.fresh = [], [], False
                seq.decoding, seq.queued_at, seq.wait_logged = False, now, False
            for seq in [*moved, *(x for x in self._waiting if x.router == r)]:
                seq.pending, seq.router = 0, -1
            self._waiting.extendleft(reversed(moved))
            self.readmitted += len(moved)
            new_replay = None
            if replay is not None:
                new_replay = tuple(RouterWork() if i == r else w for i, w in enumerate(replay))
            issued: deque = deque()
            for work, entries in self._issued:
                kept = [e for e in entries if id(e[0]) not in gone]
                if work is replay:
                    work = new_replay
                if kept:
                    issued.append((work, kept))
            self._issued = issued
        self.work_available.set()
        return new_replay

    def router_joined(self, r: int, num_blocks: int) -> None:
        """Router ``r`` is in the world again (a replacement) with ``num_blocks`` free KV blocks."""
        with self._lock:
            self._blocks[r] = self.new_allocator(num_blocks)
            self._open[r] = True
        self.work_available.set()

    @property
    def routers_open(self) -> list[bool]:
        return list(self._open)

    # -- any thread ------------------------------------------------------------------------

    def submit(self, req: GenerateRequest, sink: Callable[[Event], None] | None = None, grammar: int = -1) -> Sequence:
        """Queue a validated request (``grammar``: the id of its grammar); QueueFull when ``max_waiting`` requests wait already."""
        hashes: list[bytes] = []
        root = prefix_root(req.cache_salt) if self.prefix_caching else b""
        if self.prefix_caching:  # the prompt's block hashes, off the step driver's thread
            extend_hashes(hashes, req.prompt_ids, self.block_size, root)
        with self._lock:
            if len(self._waiting) >= self.limits.max_waiting:
                raise QueueFull(
                    f"the admission queue is full ({self.limits.max_waiting} waiting requests); retry later"
                )
            seq = Sequence(next(self._ids), req, frozenset() if req.ignore_eos else self.eos_ids, sink, grammar=grammar)
            seq.known = list(req.prompt_ids)
            seq.root, seq.hashes = root, hashes
            self._waiting.append(seq)
        self.work_available.set()
        return seq

    def cancel(self, seq: Sequence) -> None:
        with self._lock:
            seq.cancelled = True
        self.work_available.set()

    def counts(self) -> dict:
        with self._lock:
            return dict(
                waiting=len(self._waiting),
                running=sum(len(r) for r in self._running),
                kv_blocks_total=sum(a.num_blocks for a, up in zip(self._blocks, self._open) if up),
                kv_blocks_used=sum(a.num_used for a in self._blocks),
                kv_blocks_cached=sum(a.num_cached for a in self._blocks),
                preemptions=self.preemptions,
                readmitted=self.readmitted,
                prefix_cache_queries=self.prefix_queries,
                prefix_cache_hits=self.prefix_hits,
            )

    def has_room(self) -> bool:
        """Whether a request arriving now could join the next step: some open router runs fewer
        than ``max_num_seqs`` sequences (the late schedule waits for arrivals only then)."""
        with self._lock:
            cap = self.limits.max_num_seqs
            return any(up and len(run) < cap for run, up in zip(self._running, self._open))

    # -- step driver -----------------------------------------------------------------------

    def schedule(self) -> tuple[RouterWork, ...] | None:
        """The work of every router for the next step, or None when there is nothing to run."""
        with self._lock:
            self._drop_cancelled()
            budget = [self.limits.max_num_batched_tokens] * self.num_routers
            seqs: list[list[SeqWork]] = [[] for _ in range(self.num_routers)]
            decodes: list[list[int]] = [[] for _ in range(self.num_routers)]
            blocks: list[list[tuple[int, int]]] = [[] for _ in range(self.num_routers)]
            entries: list[tuple[Sequence, int, bool]] = []  # (sequence, its admission, samples)
            for r in range(self.num_routers):
                for seq in sorted(self._running[r].values(), key=lambda s: s.admitted):
                    if seq.seq_id not in self._running[r]:  # preempted earlier in this loop
                        continue
                    if seq.num_output + seq.pending >= seq.req.max_tokens:  # its last token is in flight
                        continue
                    take = min(len(seq.known) + seq.pending - seq.cached, budget[r])
                    if take > 0 and self._reserve(r, seq, take):
                        if seq.decoding:  # its one uncached token is the one it sampled last
                            decodes[r].append(seq.seq_id)
                            blocks[r].extend((seq.seq_id, b) for b in seq.new_blocks)
                            seq.cached += 1
                            seq.pending += 1
                            entries.append((seq, seq.admitted, True))
                        else:
                            sw = self._work(seq, take)
                            seqs[r].append(sw)
                            entries.append((seq, seq.admitted, sw.sample))
                            self._cache_full_blocks(seq)  # a decode's block waits for its token (on_results)
                        budget[r] -= take
            compiling: list[Sequence] = []  # waiting for their grammar: passed over, kept in order
            while self._waiting:
                seq = self._waiting[0]
                if seq.grammar >= 0 and not self.grammar_ready(seq.grammar):
                    compiling.append(self._waiting.popleft())
                    continue
                if seq.pending:  # preempted with a token in flight: recomputed once it is known
                    break
                # among the routers that can take a new sequence this step (room, token budget,
                # free blocks for its first chunk after its cached prefix there), the routing
                # policy's (a router lost takes none): one router out of budget or room does not stop
                # admission to the others
                hits = self._prefix_hits(seq)
                open_ = [
                    r for r in range(self.num_routers) if self._open[r] and self._can_admit(r, seq, hits[r], budget[r])
                ]
                if not open_:
                    self._log_long_wait(seq, budget)
                    break
                r = self._route(open_, hits)
                self._waiting.popleft()
                self._admit(r, seq, hits[r])
                take = min(len(seq.known) - seq.cached, budget[r])
                self._reserve(r, seq, take)
                sw = self._work(seq, take)
                self._cache_full_blocks(seq)
                seqs[r].append(sw)
                entries.append((seq, seq.admitted, sw.sample))
                budget[r] -= take
            self._waiting.extendleft(reversed(compiling))
            release = [tuple(x) for x in self._release]
            self._release = [[] for _ in range(self.num_routers)]
            if not entries and not any(release):
                return None
            work = tuple(
                RouterWork(
                    seqs=tuple(seqs[r]),
                    release=release[r],
                    decodes=np.array(decodes[r], dtype=np.int64) if decodes[r] else RouterWork().decodes,
                    blocks=np.array(blocks[r], dtype=np.int64) if blocks[r] else RouterWork().blocks,
                )
                for r in range(self.num_routers)
            )
            if entries:
                self._issued.append((work, entries))
            return work

    def _reads_prefix_cache(self, seq: Sequence) -> bool:
        """Whether ``seq`` may start with cached blocks: not when it needs the logits of every
        prompt token (``return_logits == "all"``) or the logprobs of every prompt token
        (``prompt_logprobs`` >= 0: prompt logprobs, echo with logprobs), which only a computation
        of the whole prompt gives (as vLLM does)."""
        # a penalized sequence reads the cache too: its fresh record carries the cached prefix's
        # ids (``SeqWork.prefix_ids``), from which its router fills the penalty state
        return self.prefix_caching and seq.req.return_logits != "all" and seq.req.prompt_logprobs < 0

    def _prefix_hits(self, seq: Sequence) -> list[list[int]]:
        """Per router, the cached blocks ``seq`` would start with there: the longest cached
        prefix of its known tokens in whole blocks, leaving at least its last token to compute
        (it samples from that token's logits); a constrained or penalized sequence at most its
        prompt (its router's matcher, and its penalty counts, take its outputs from the chunks)."""
        if not self._reads_prefix_cache(seq):
            return [[] for _ in range(self.num_routers)]
        extend_hashes(seq.hashes, seq.known, self.block_size, seq.root)
        computed = len(seq.known) - 1
        if seq.grammar >= 0 or seq.req.sampling.penalized:  # outputs reach the router as chunks
            computed = min(computed, len(seq.req.prompt_ids))
        want = seq.hashes[: computed // self.block_size]
        return [a.match(want) for a in self._blocks]

    def _can_admit(self, r: int, seq: Sequence, hit: list[int], budget: int) -> bool:
        """Router r has room for one more sequence, token budget left in this step, and free
        blocks for ``seq``'s first chunk after the ``hit`` blocks it would start with there
        (idle cached blocks among them count as free until it takes them)."""
        if len(self._running[r]) >= self.limits.max_num_seqs or budget <= 0:
            return False
        have = len(hit) * self.block_size
        need = blocks_for(have + min(len(seq.known) - have, budget), self.block_size) - len(hit)
        alloc = self._blocks[r]
        return need <= alloc.num_free - alloc.num_idle(hit)

    def _route(self, open_: list[int], hits: list[list[int]]) -> int:
        """The router of ``open_`` that a new sequence goes to (the module docstring)."""
        if self.routing == "round_robin":
            r = min(open_, key=lambda x: (x - self._turn - 1) % self.num_routers)
            self._turn = r
            return r
        least = min(len(self._running[x]) for x in open_)
        near = [x for x in open_ if len(self._running[x]) <= least + max(1, self.limits.max_num_seqs // 8)]
        return max(near, key=lambda x: (len(hits[x]), -len(self._running[x]), -x))

    def _admit(self, r: int, seq: Sequence, hit: list[int]) -> None:
        """Pin ``seq`` to router r, starting with the cached blocks ``hit``."""
        seq.router, seq.admitted = r, next(self._admissions)
        if seq.scheduled_at is None:
            seq.scheduled_at = time.monotonic()
        self._running[r][seq.seq_id] = seq
        self._blocks[r].share(hit)
        seq.blocks, seq.hashed, seq.fresh = list(hit), len(hit), True
        seq.cached = len(hit) * self.block_size
        if seq.prefix_hit < 0:  # its first admission: what usage and the hit counters report
            seq.prefix_hit = seq.cached
            if self._reads_prefix_cache(seq):
                self.prefix_queries += len(seq.req.prompt_ids)
                self.prefix_hits += seq.cached

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Offer to the prefix cache every block of ``seq`` that the steps scheduled so far
        fill and whose tokens the leader knows (a decode's token may still be in flight)."""
        if not self.prefix_caching:
            return
        n = min(min(seq.cached, len(seq.known)) // self.block_size, len(seq.blocks))
        if n <= seq.hashed:
            return
        extend_hashes(seq.hashes, seq.known, self.block_size, seq.root)
        alloc = self._blocks[seq.router]
        for i in range(seq.hashed, n):
            alloc.cache(seq.blocks[i], seq.hashes[i])
        seq.hashed = n

    def _log_long_wait(self, seq: Sequence, budget: list[int]) -> None:
        """Say once why the head of the queue has waited longer than ``LONG_WAIT_S``: every
        router out of room (max_num_seqs), token budget or free blocks."""
        waited = time.monotonic() - seq.queued_at
        if seq.wait_logged or waited < LONG_WAIT_S:
            return
        seq.wait_logged = True
        need = blocks_for(len(seq.known), self.block_size)
        log.warning(
            "request %d has waited %.2f s for admission (%d waiting): per router running/max_num_seqs "
            "%s, token budget left %s, free blocks %s (it needs %d for its %d known tokens)",
            seq.seq_id,
            waited,
            len(self._waiting),
            [f"{len(self._running[r])}/{self.limits.max_num_seqs}" for r in range(self.num_routers)],
            budget,
            [a.num_free for a in self._blocks],
            need,
            len(seq.known),
        )

    def _reserve(self, r: int, seq: Sequence, take: int) -> bool:
        """Give ``seq`` the blocks for ``take`` more tokens, preempting the newest running
        sequences of router r while none are free; False when ``seq`` itself was preempted."""
        if seq.cached + take <= len(seq.blocks) * self.block_size:  # most decode steps: room left
            seq.new_blocks = []
            return True
        alloc = self._blocks[r]
        need = blocks_for(seq.cached + take, self.block_size) - len(seq.blocks)
        while need > alloc.num_free:
            victim = max(self._running[r].values(), key=lambda s: s.admitted)
            self._preempt(r, victim)
            if victim is seq:
                return False
        seq.new_blocks = alloc.allocate(max(0, need))
        seq.blocks.extend(seq.new_blocks)
        return True

    def _work(self, seq: Sequence, take: int) -> SeqWork:
        """The SeqWork of ``take`` known tokens of ``seq`` (a prompt, a chunk, a recomputation);
        counts them cached and, when it samples, its token in flight (the results of this step
        are consumed later, maybe after the next step is scheduled)."""
        start = seq.cached
        known = seq.known
        last = start + take == len(known)
        fresh, seq.fresh = seq.fresh, False
        work = SeqWork(
            seq_id=seq.seq_id,
            token_ids=tuple(known[start : start + take]),
            start=start,
            sampling=seq.req.sampling if fresh else None,
            return_logits=seq.req.return_logits,
            new_blocks=tuple(seq.blocks if fresh else seq.new_blocks),  # a fresh record: its whole table
            sample=last,
            out_pos=len(known) - len(seq.req.prompt_ids),
            # scored in the first pass only: a sequence recomputed after its first token has them
            prompt_logprobs=seq.req.prompt_logprobs if len(known) == len(seq.req.prompt_ids) else -1,
            grammar=seq.grammar if fresh else -1,  # a fresh record starts its matcher
            # a penalized record on cached blocks: the ids of what it reads (its penalty state)
            prefix_ids=tuple(known[:start]) if fresh and start and seq.req.sampling.penalized else (),
        )
        seq.cached = start + take
        if last:
            seq.pending += 1
            seq.decoding = True
        return work

    def _preempt(self, r: int, seq: Sequence) -> None:
        self._blocks[r].free(seq.blocks)  # its cached blocks stay cached: it may find them again
        seq.blocks, seq.cached, seq.hashed, seq.partial_logits, seq.decoding = [], 0, 0, [], False
        seq.partial_plp = []
        del self._running[r][seq.seq_id]
        self._release[r].append(seq.seq_id)
        seq.queued_at, seq.wait_logged = time.monotonic(), False
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def on_results(
        self,
        work: tuple[RouterWork, ...],
        tokens: dict[int, int],
        logits: dict[int, np.ndarray],
        plp: dict | None = None,
    ) -> None:
        """Record the tokens sampled in the step that ran ``work`` (a value ``schedule``
        returned; its results may come after later steps were scheduled) and finish the
        sequences that are done. Tokens of sequences that finished or were cancelled meanwhile
        are dropped; a preempted sequence keeps its token (it is recomputed with it). ``plp``:
        the prompt logprobs (``PromptLogprobs``) each sequence's chunk scored, joined over
        chunks and handed out with its first token."""
        plp = plp or {}
        with self._lock:
            entry = None
            for i, (w, seqs) in enumerate(self._issued):
                if w is work:
                    entry = seqs
                    del self._issued[i]
                    break
            if entry is None:
                return
            for seq, admitted, samples in entry:
                lg = logits.get(seq.seq_id)
                pl = plp.get(seq.seq_id)
                if not samples:  # a prefill chunk: nothing sampled yet
                    if seq.admitted == admitted and seq.finished is None:
                        if lg is not None:
                            seq.partial_logits.append(lg)
                        if pl is not None:
                            seq.partial_plp.append(pl)
                    continue
                seq.pending -= 1
                if seq.finished is not None:  # finished or cancelled meanwhile
                    continue
                if seq.partial_logits and lg is not None:
                    lg = np.concatenate([*seq.partial_logits, lg])
                    seq.partial_logits = []
                if pl is not None and seq.partial_plp:
                    pl = PromptLogprobs.concat([*seq.partial_plp, pl])
                seq.partial_plp = []
                tok = tokens[seq.seq_id]
                seq.known.append(tok)
                if len(seq.known) // self.block_size > seq.hashed and seq.seq_id in self._running[seq.router]:
                    self._cache_full_blocks(seq)  # a block its decodes filled may now be known whole
                if len(seq.known) == len(seq.req.prompt_ids) + 1:  # says how much of the prompt was cached
                    now, wall = time.monotonic(), time.time()
                    sched = seq.scheduled_at if seq.scheduled_at is not None else now
                    seq.emit(
                        FirstToken(
                            tok,
                            lg,
                            pl,
                            max(seq.prefix_hit, 0),
                            queued_s=sched - seq.arrived_at,
                            prefill_s=now - sched,
                            hops=HopTimes(arrived=wall - (now - seq.arrived_at), known=wall),
                        )
                    )
                else:
                    seq.emit(Token(tok, lg, pl))
                reason = None
                if tok in seq.eos_ids or tok in seq.req.stop_token_ids:
                    reason = FinishReason.STOP
                elif seq.num_output >= seq.req.max_tokens:  # admission keeps prompt + max_tokens <= max_model_len
                    reason = FinishReason.LENGTH
                if reason:
                    if seq.seq_id in self._running[seq.router]:
                        self._finish(seq.router, seq, reason)
                    else:  # preempted, waiting to be recomputed
                        self._waiting.remove(seq)
                        seq.finished = reason
                        seq.emit(Finished(reason))

    def fail_grammar(self, gid: int, message: str) -> None:
        """The waiting sequences of grammar ``gid`` fail: it could not be compiled (their own
        fault: ``Failed(invalid=True)``)."""
        with self._lock:
            for seq in [s for s in self._waiting if s.grammar == gid]:
                self._waiting.remove(seq)
                seq.emit(Failed(message, invalid=True))

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
        self._blocks[r].free(seq.blocks)
        seq.blocks = []
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
