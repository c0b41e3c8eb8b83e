"""Messages of the step protocol (docs/dataplane.md): the header every rank receives at the
start of a step, and what each rank sends back to the leader at its end.

The header travels as int64 words in a preallocated buffer (``header_wire``), the rank results
pickled, both on the gloo control group; all are immutable values of plain Python values and
numpy arrays (never torch tensors on a device), so a header means the same on every rank
whatever its device. The per-sequence and per-router work are named tuples, which pickle as
plain tuples: a decode step's header carries one per running sequence, and a frozen
dataclass (pickled with its field names and state dict) cost 2-3x as much to pickle and
unpickle.

Dimension letters: L MoE layers, E logical experts, P physical slots per MoE layer, W workers,
V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from moeserve.grammar import GrammarSpec
from moeserve.sampling import SamplingParams


class SeqWork(NamedTuple):
    """One sequence's share of a step on its router.

    token_ids: the new tokens of this step (a prompt or a chunk of it, a recomputed prompt plus
    the tokens it had produced, or the last sampled token when the leader knows it); start: tokens already in this
    sequence's KV cache on the router (for a fresh sequence, those it reads from cached blocks:
    a multiple of the block size, often 0); sampling: set on a sequence's first work on its
    router, and only then (``fresh``: new, or recomputed after a preemption; its seed is always
    set, by the leader): the router starts a fresh record; new_blocks: for a fresh sequence its
    whole block table, the cached blocks it starts with first, else the KV block ids the leader
    appended to its block table for this step; sample: whether a token is sampled at the end of this step (False for a prefill chunk that
    is not the prompt's last); out_pos: the index of that token among the request's outputs
    (the sampler's counter); return_logits: "" (none), "last" (the logits the token is sampled
    from) or "all" (every new position); pending: never on the wire: the router's own entry
    for a decode of ``RouterWork.decodes``, whose one new token is the token the sequence
    sampled in the step before, on the device (``token_ids`` is then empty); prompt_logprobs:
    how many top tokens to return per prompt position beside each position's own logprob (echo,
    prompt_logprobs; -1: none), computed on the router for the chunk's positions
    (``RankResult.prompt_logprobs``); grammar: with ``sampling``, the id of the grammar the
    sequence's tokens are constrained to (announced to the routers in an earlier header's
    ``StepHeader.grammars``; -1: none); prefix_ids: with ``sampling``, for a penalized sequence
    that starts on cached blocks, the ids of the ``start`` tokens it reads from them (its
    router's penalty state counts every prompt token; they are not written: () otherwise).
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start: int
    sampling: SamplingParams | None = None
    return_logits: str = ""
    new_blocks: tuple[int, ...] = ()
    sample: bool = True
    out_pos: int = 0
    pending: bool = False
    prompt_logprobs: int = -1
    grammar: int = -1
    prefix_ids: tuple[int, ...] = ()

    @property
    def num_new(self) -> int:
        """Tokens this step writes to the sequence's KV cache."""
        return len(self.token_ids) + self.pending

    @property
    def fresh(self) -> bool:
        """The sequence's first work on its router: ``new_blocks`` is its whole block table."""
        return self.sampling is not None


_NO_IDS = np.zeros(0, dtype=np.int64)
_NO_BLOCKS = np.zeros((0, 2), dtype=np.int64)


class RouterWork(NamedTuple):
    """What one router does in a step: forget ``release`` (finished, cancelled or preempted
    sequences whose KV cache and sampler can go), then run ``seqs`` and ``decodes``.

    seqs: sequences whose new tokens the leader sends (a prompt, a chunk of it, a recomputed
    sequence); decodes: int64 [D] ids of sequences that decode one token, the token they
    sampled in their last step, which the router holds on the device (the leader may not have
    seen it yet): the router knows each one's position and output index, so a decode costs the
    header 8 bytes; blocks: int64 [k, 2] (sequence id, block id) KV blocks the decodes gain
    (appended to their block tables before the step).
    """

    seqs: tuple[SeqWork, ...] = ()
    release: tuple[int, ...] = ()
    decodes: np.ndarray = _NO_IDS
    blocks: np.ndarray = _NO_BLOCKS

    @property
    def runs(self) -> bool:
        return bool(self.seqs) or len(self.decodes) > 0

    def sampled_ids(self) -> list[int]:
        """The sequences that sample a token in this step."""
        return [sw.seq_id for sw in self.seqs if sw.sample] + self.decodes.tolist()


@dataclass(frozen=True)
class PromptLogprobs:
    """The logprobs of prompt tokens a router computed (``sampling.prompt_logprobs``), n
    positions, each scoring the prompt token that follows it; K top tokens.

    logprob float32 [n], rank int64 [n], top_ids int64 [n, K], top_logprobs float32 [n, K]."""

    logprob: np.ndarray
    rank: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray

    @staticmethod
    def concat(parts: list[PromptLogprobs]) -> PromptLogprobs:
        return PromptLogprobs(*(np.concatenate([getattr(p, f) for p in parts]) for f in _PLP_FIELDS))


_PLP_FIELDS = ("logprob", "rank", "top_ids", "top_logprobs")


@dataclass(frozen=True)
class MoveOp:
    """Copy logical expert ``logical`` of MoE layer ``moe_layer`` from worker ``src_worker``
    (which holds it in slot ``src_slot`` of the placement in force) into staging entry
    ``stage`` of worker ``dst_worker``, destined for its global slot ``slot``."""

    moe_layer: int
    slot: int
    logical: int
    src_worker: int
    src_slot: int
    dst_worker: int
    stage: int


@dataclass(frozen=True)
class LayerCommit:
    """Switch MoE layer ``moe_layer`` to ``phy2log`` ([P] logical expert per slot) and its
    break-even counts ``breakeven`` ([E], the replica rule's b; empty: 0, every replica always
    used) at version ``version``. Workers copy each staged entry into its slot: ``staged``
    lists (global slot, staging entry) pairs of this layer's moves (none when only b changes)."""

    moe_layer: int
    phy2log: tuple[int, ...]
    version: int
    staged: tuple[tuple[int, int], ...]
    breakeven: tuple[int, ...] = ()


@dataclass(frozen=True)
class MigrationOps:
    """The migration work of one step, applied in this order: ``begin`` (workers allocate
    ``staging_slots`` staging entries), ``commits``, ``rollback`` (drop what is staged but
    uncommitted), ``moves``, ``end`` (free staging)."""

    migration_id: str
    begin_staging_slots: int = 0
    commits: tuple[LayerCommit, ...] = ()
    rollback: bool = False
    moves: tuple[MoveOp, ...] = ()
    end: bool = False


@dataclass(frozen=True)
class StepHeader:
    """Broadcast by the leader at the start of every step.

    work has one entry per router when ``forward`` is set (idle routers get an empty one);
    a step without ``forward`` is a heartbeat or a migration-only step. ``grammars``: (id,
    spec) of the grammars every router compiles from now on, off the step path, and reports in
    ``RankResult.grammars``; ``drop_grammars``: ids no sequence uses any more (docs/engine.md,
    "Structured output").
    """

    step: int
    forward: bool = False
    work: tuple[RouterWork, ...] = ()
    migration: MigrationOps | None = None
    report: bool = False  # workers send a digest of every slot's weights
    read_load: bool = False  # routers send the load of the forward steps before this one
    # (bucket, longest sequence): a decode graph warm-up step; (tokens, -sequences): a mixed-step one
    warmup: tuple[int, int] | None = None
    stop: bool = False
    regroup: bool = False  # after this step every rank re-forms the world (a rank joins)
    grammars: tuple[tuple[int, GrammarSpec], ...] = ()
    drop_grammars: tuple[int, ...] = ()


@dataclass
class RankResult:
    """What a rank sends to the leader at the end of a step (gathered on the control group).

    Routers: ``tokens`` maps a sequence id to the token it sampled in step ``tokens_step``
    (-1: none; with asynchronous steps the step before this one, else this one), ``logits`` to
    float32 arrays [n, V] when asked for (of the same step); when the header set ``read_load``:
    ``logical_load`` int64 [L, E] (pairs routed to each logical expert) and ``worker_load``
    int64 [L, W] (pairs sent to each worker) of the ``load_steps`` forward steps since the
    previous read, and their per-step statistics (``router.dispatcher.DistributedExperts``):
    ``histogram`` int64 [L, E, K] (per step and expert, the replica rule's estimate of the
    step's count, in power-of-two bins) and ``slot_busy`` int64 [L, P] (steps in which this
    router sent a pair to the slot).
    Workers: ``staging_error`` when staging could not be allocated (the migration is then
    rolled back); ``slot_digest`` when the header asked for a report.
    Routers, when the header asked for a report: ``router_maps``, the maps they route with
    (phy2log int64 [L, P], breakeven int64 [L, E]).
    """

    rank: int
    tokens: dict[int, int] = field(default_factory=dict)
    logits: dict[int, np.ndarray] = field(default_factory=dict)
    tokens_step: int = -1
    logical_load: np.ndarray | None = None
    worker_load: np.ndarray | None = None
    load_steps: int = 1
    histogram: np.ndarray | None = None
    slot_busy: np.ndarray | None = None
    staging_error: str | None = None
    slot_digest: np.ndarray | None = None  # float64 [L, S, 2] (sum, sum of squares) per slot, when asked
    # sequence id -> PromptLogprobs of the prompt positions a step's chunk scored (same step as logits)
    prompt_logprobs: dict = field(default_factory=dict)
    router_maps: tuple | None = None  # (phy2log [L, P], breakeven [L, E]) of a router, when asked
    # routers: the grammars compiled since the last result, id -> "" (ready) or why it failed
    grammars: dict = field(default_factory=dict)
    # the step's host timings on this rank (time.perf_counter; the leader's pacer reads them,
    # moeserve.router.engine.pacing): when run_step began, the time from then to the end of the
    # step's enqueue, when the tokens it delivers were read and how long it waited for them
    started_at: float = 0.0
    enqueue_s: float = 0.0
    tokens_at: float = 0.0
    tokens_wait_s: float = 0.0
