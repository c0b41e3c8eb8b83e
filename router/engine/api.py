"""The engine's typed API: what the leader's engine accepts, answers and raises.

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers, V vocabulary.

One interface, :class:`EngineAPI`, two front doors: the local channel
(``moeserve.router.engine.channel``: the launcher and the serving front end, in other
processes) and the gRPC admin service (``moeserve.services.admin``, in the leader's process).
Both serve these methods with these values; both map these exceptions, the gRPC side through
one table (``moeserve.services.errors``). Inside the engine values are typed and trusted:
every boundary validates once (a request in :meth:`EngineAPI.submit`, a placement in
:meth:`EngineAPI.plan_placement` / :meth:`EngineAPI.apply_placement`).

Nothing here imports torch, torch.distributed or gRPC.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from moeserve.dataplane.protocol import PromptLogprobs
from moeserve.grammar import GrammarSpec
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.sampling import SamplingParams

__all__ = [
    "EngineError",
    "InvalidRequest",
    "QueueFull",
    "StaleVersion",
    "EplbDisabled",
    "NotFound",
    "Unavailable",
    "FinishReason",
    "GenerateRequest",
    "Token",
    "FirstToken",
    "HopTimes",
    "Finished",
    "Failed",
    "Event",
    "ModelShape",
    "LoadReport",
    "EngineStatus",
    "EngineAPI",
    "MigrationProgress",
    "MigrationState",
    "validate_request",
    "REMOTE_METHODS",
]


# -- exceptions: what went wrong, for the caller to map ---------------------------------------


class EngineError(Exception):
    """Base of everything the engine raises on purpose; the message says what and what is allowed."""


class InvalidRequest(EngineError, ValueError):
    """Bad input: a request, a placement, an argument (gRPC INVALID_ARGUMENT)."""


class QueueFull(EngineError):
    """The admission queue is at ``max_waiting``: retry later (gRPC RESOURCE_EXHAUSTED)."""


class StaleVersion(EngineError):
    """The caller's expected placement version is not the version in force (FAILED_PRECONDITION)."""


class EplbDisabled(EngineError):
    """A placement change was asked of a cluster started without EPLB (FAILED_PRECONDITION)."""


class NotFound(EngineError, LookupError):
    """No such migration (NOT_FOUND)."""


class Unavailable(EngineError, RuntimeError):
    """The cluster failed or is stopping (UNAVAILABLE)."""


# -- requests and their events ----------------------------------------------------------------


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS or a stop token id
    LENGTH = "length"  # max_tokens or max_model_len
    CANCELLED = "cancelled"  # the client went away or cancelled


RETURN_LOGITS = ("", "last", "all")
MAX_PROMPT_LOGPROBS = 1024  # top tokens per prompt position
MAX_CACHE_SALT_BYTES = 1024


@dataclass(frozen=True)
class GenerateRequest:
    """One generation request, in token ids. ``return_logits``: "" (none), "last" (the logits
    [1, V] each token is sampled from) or "all" (every prompt position too, at prefill; such a
    request computes its whole prompt, never reading the prefix cache). ``prompt_logprobs``: K >= 0
    asks for the logprob of every prompt token after the first, with its rank and the K most likely
    tokens at its position, computed on the routers (the first ``Token`` carries them; such a
    request computes its whole prompt too); -1: none.
    ``cache_salt`` (vLLM's name): requests share cached KV blocks only with requests of the same
    salt. ``grammar``: the tokens must follow it (structured output, checked by the front end:
    ``moeserve.grammar.check``); the routers compile it before the request is scheduled
    (docs/engine.md, "Structured output")."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_logits: str = ""
    prompt_logprobs: int = -1
    cache_salt: str = ""
    grammar: GrammarSpec | None = None


@dataclass(frozen=True)
class Token:
    """A generated token; ``logits`` float32 [n, V] when the request asked for them; the first
    token of a request that asked for prompt logprobs carries them (``PromptLogprobs`` of the
    prompt's tokens 1 .. P-1)."""

    token_id: int
    logits: np.ndarray | None = None
    prompt_logprobs: PromptLogprobs | None = None


@dataclass(slots=True)
class HopTimes:
    """Wall-clock stamps (``time.time()``, seconds) of a request's way to its first token, each
    written by the hop that saw it (0.0: not seen; processes differ, so the clock is the wall's):
    ``sent`` the front end wrote the submit to the local channel, ``received`` the leader's
    channel read it, ``arrived`` the engine took it (``queued_s`` counts from here), ``known`` the
    leader learned the first token (``prefill_s`` ends here), ``written`` the leader's channel
    wrote the event's frame, ``read`` the front end's channel read that frame. Mutable: the one
    object travels with its :class:`FirstToken` and each hop fills its own field."""

    sent: float = 0.0
    received: float = 0.0
    arrived: float = 0.0
    known: float = 0.0
    written: float = 0.0
    read: float = 0.0


@dataclass(frozen=True)
class FirstToken(Token):
    """A request's first generated token, with ``cached_tokens``: how many of its prompt tokens
    were read from the prefix cache instead of computed (every later token is a plain Token,
    which keeps the event of a decode step small); and the leader's clock of it: ``queued_s``
    from the engine taking the request to its first admission to a router (vLLM's queue time),
    ``prefill_s`` from there to the leader learning its first token (vLLM's prefill time);
    ``hops``: when it passed each hop between the front end and the leader (:class:`HopTimes`)."""

    cached_tokens: int = 0
    queued_s: float = field(default=0.0, compare=False)  # timings: not what the event says
    prefill_s: float = field(default=0.0, compare=False)
    hops: HopTimes | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason


@dataclass(frozen=True)
class Failed:
    """The cluster failed under the request; ``message`` says how. ``invalid``: the request
    itself was at fault (its grammar did not compile on a router: a bad request, not a failure
    of the cluster)."""

    message: str
    invalid: bool = False


Event = Token | Finished | Failed
"""A request's events: Token* then one Finished or Failed."""


def validate_request(req: GenerateRequest, vocab_size: int, max_model_len: int, max_kv_tokens: int) -> None:
    """Raise InvalidRequest saying what is wrong and what is allowed. Called once per request,
    by :meth:`EngineAPI.submit`, before the request can reach a step. ``max_kv_tokens``: the
    most tokens one router's KV cache holds (a request that could never fit is refused)."""
    if not req.prompt_ids:
        raise InvalidRequest("the prompt is empty: give at least one token")
    # Python's comparisons first: an id too large for int64 is a bad request, not an overflow.
    lo, hi = min(req.prompt_ids), max(req.prompt_ids)
    if lo < 0 or hi >= vocab_size:
        raise InvalidRequest(f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")
    bad = [t for t in req.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if req.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be >= 1, got {req.max_tokens}")
    if not 0 <= req.sampling.top_k <= vocab_size:
        raise InvalidRequest(
            f"top_k must be in 0..{vocab_size} (0 = no top-k filtering, at most the vocabulary), "
            f"got {req.sampling.top_k}"
        )
    total = len(req.prompt_ids) + req.max_tokens
    if total > max_model_len:
        raise InvalidRequest(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) = {total} "
            f"exceeds max_model_len {max_model_len}"
        )
    if total > max_kv_tokens:
        raise InvalidRequest(
            f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) = {total} "
            f"can never fit in a router's KV cache ({max_kv_tokens} tokens): lower max_tokens "
            f"or give the cache more memory"
        )
    if req.return_logits not in RETURN_LOGITS:
        raise InvalidRequest(f"return_logits must be '', 'last' or 'all', got {req.return_logits!r}")
    if not -1 <= req.prompt_logprobs <= min(vocab_size, MAX_PROMPT_LOGPROBS):
        raise InvalidRequest(
            f"prompt_logprobs must be in -1..{min(vocab_size, MAX_PROMPT_LOGPROBS)} (-1: none), got {req.prompt_logprobs}"
        )
    sp = req.sampling
    if sp.min_tokens > req.max_tokens:
        raise InvalidRequest(f"min_tokens ({sp.min_tokens}) must be <= max_tokens ({req.max_tokens})")
    biased = [t for t, _ in sp.logit_bias if not 0 <= t < vocab_size] + [
        t for t in sp.stop_ids if not 0 <= t < vocab_size
    ]
    if biased:
        raise InvalidRequest(f"token id {biased[0]} of logit_bias is outside the vocabulary [0, {vocab_size})")
    if len(req.cache_salt.encode()) > MAX_CACHE_SALT_BYTES:
        raise InvalidRequest(
            f"cache_salt is {len(req.cache_salt.encode())} bytes of UTF-8; at most {MAX_CACHE_SALT_BYTES} are allowed"
        )
    if req.grammar is not None:
        if not isinstance(req.grammar, GrammarSpec):
            raise InvalidRequest(f"grammar must be a GrammarSpec, got {type(req.grammar).__name__}")
        if sp.min_tokens:
            raise InvalidRequest("min_tokens cannot be combined with structured output (the grammar decides the end)")


# -- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """What the leader needs to know of the model."""

    num_moe_layers: int
    num_logical_experts: int
    top_k: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    expert_bytes: int
    moe_layer_ids: tuple[int, ...] = ()  # decoder-layer index of each MoE layer
    num_decoder_layers: int = 0
    num_expert_groups: int = 1  # group-limited routing's groups (MoEInfo.num_expert_groups)


@dataclass(frozen=True)
class LoadReport:
    """The load window and what it says.

    load:      int64 [L, E], pairs routed to each logical expert over the window (all routers).
    worker_load: int64 [L, W], pairs sent to each worker over the window (measured under the
               placements that were in force; may mix placements across a migration).
    steps:     forward steps in the window (at most window_size).
    balancedness_measured:  [L] mean/max of worker_load per layer (1.0 for a layer without tokens).
    balancedness_predicted: [L] the same for ``load`` split evenly over the replicas of the
               placement in force (what the policy's cost model predicts).
    histogram: int64 [L, E, K] or None: per step, router and expert, the replica rule's estimate
               of the step's count (the router's pairs x routers) in power-of-two bins (bin 0: no
               pair, bin j: 2**(j-1) .. 2**j - 1), summed over routers and the window's steps.
    slot_busy_steps: int64 [L, P] or None: per slot, the (router, step) pairs of the window in
               which a router sent the slot at least one pair (with one router: the steps the
               slot's weights were read).
    """

    load: np.ndarray
    worker_load: np.ndarray
    steps: int
    total_steps: int
    balancedness_measured: np.ndarray
    balancedness_predicted: np.ndarray
    placement_version: int
    steps_since_placement_change: int = 0
    histogram: np.ndarray | None = None
    slot_busy_steps: np.ndarray | None = None


@dataclass(frozen=True)
class EngineStatus:
    """The leader's state at one moment. ``metrics_ports``: name ("rank0", "balancer", ...) ->
    Prometheus port; ``migration``: the running migration, if any."""

    step: int
    forward_steps: int
    uptime_s: float
    placement_version: int
    layer_versions: tuple[int, ...]
    migration: MigrationProgress | None
    error: str | None
    waiting: int
    running: int
    metrics_ports: dict[str, int] = field(default_factory=dict)
    kv_blocks_total: int = 0  # KV blocks of every router, and those in use
    kv_blocks_used: int = 0
    preemptions: int = 0  # sequences preempted (recomputed later) since start
    kv_blocks_cached: int = 0  # KV blocks holding a prefix-cache hash (in use or idle)
    prefix_cache_queries: int = 0  # prompt tokens of admitted requests that looked the prefix cache up
    prefix_cache_hits: int = 0  # of them, those read from the cache
    moved_slots: int = 0  # slots and bytes moved by migrations since start
    moved_bytes: int = 0
    migrations_ended: dict[str, int] = field(default_factory=dict)  # state name -> count
    last_step_age_s: float = 0.0  # seconds since the last step completed (a stall: health)
    readmitted: int = 0  # sequences of a lost router recomputed on another since start
    generation: int = 0  # how many times the world re-formed (a lost or joining rank)
    members: tuple[int, ...] = ()  # the ranks in the world now
    ranks_in_world: dict[str, int] = field(default_factory=dict)  # role -> ranks in the world now
    ranks_lost: dict[str, int] = field(default_factory=dict)  # role -> ranks lost since start
    ranks_replaced: dict[str, int] = field(default_factory=dict)  # role -> replacements that joined
    late_schedules: int = 0  # schedules the leader's pacer delayed since start, and their total
    late_schedule_delay_s: float = 0.0
    late_schedule_bubbles: int = 0  # delayed schedules after which the GPU went idle first
    late_schedule_ahead_s: float = 0.0  # their time before the running step's estimated end, in total
    late_schedule_slack_s: float = 0.0  # the GPU's wait for the delayed steps, in total


_delivery = threading.local()  # the step driver's: the wake-ups a step's delivery deferred


@contextlib.contextmanager
def step_delivery():
    """The events a step delivers inside this block leave it together: a sink that wakes a
    consumer (the channel's session) defers the wake-up to the block's end
    (``after_delivery``), so that a step's events are taken as one batch, however the threads
    interleave; the step driver's thread only."""
    _delivery.wakes = {}
    try:
        yield
    finally:
        wakes, _delivery.wakes = _delivery.wakes, None
        for wake in wakes.values():
            wake()


def after_delivery(key: object, wake: Callable[[], None]) -> bool:
    """Defer ``wake`` (once per ``key``) to the end of the step delivery running on this thread;
    False where none runs (the caller wakes its consumer now)."""
    wakes = getattr(_delivery, "wakes", None)
    if wakes is None:
        return False
    wakes.setdefault(key, wake)
    return True


# -- the interface ----------------------------------------------------------------------------


class RemoteEngineAPI(Protocol):
    """The part of :class:`EngineAPI` that the local channel also serves to other processes
    (:data:`REMOTE_METHODS`; ``moeserve.router.engine.channel.EngineClient`` calls it there)."""

    def placement(self) -> Placement: ...

    def plan_placement(self, phy2log: np.ndarray | Placement, expected_version: int | None = None) -> MigrationProgress:
        """Validate ``phy2log [L, P]`` (or a Placement, break-even counts included) and diff it
        against the placement in force (dry run)."""
        ...

    def apply_placement(
        self, phy2log: np.ndarray | Placement, expected_version: int | None = None
    ) -> MigrationProgress:
        """Start migrating to ``phy2log [L, P]`` (or a Placement); returns at once."""
        ...

    def migration(self, migration_id: str) -> MigrationProgress: ...

    def wait_migration(self, migration_id: str, timeout_s: float) -> MigrationProgress:
        """The migration once it ended, or after ``timeout_s``, whichever comes first."""
        ...

    def abort_migration(self) -> bool: ...

    def expert_load(self, window_steps: int | None = None) -> LoadReport: ...

    def total_load(self) -> np.ndarray:
        """int64 [L, E]: pairs routed to each logical expert since start."""
        ...

    def total_worker_load(self) -> np.ndarray:
        """int64 [L, W]: pairs sent to each worker since start."""
        ...

    def status(self) -> EngineStatus: ...

    def slot_digests(self, timeout_s: float = 60.0) -> list[np.ndarray]:
        """Per worker, float64 [L, S, 2] (sum, sum of squares) of what each slot holds."""
        ...

    def router_maps(self, timeout_s: float = 60.0) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per router, the maps it routes with: (phy2log int64 [L, P], breakeven int64 [L, E])."""
        ...

    def request_stop(self) -> None: ...


class EngineAPI(RemoteEngineAPI, Protocol):
    """What the leader's engine offers to every front door (a Protocol: the engine implements
    it, the channel's client serves its RemoteEngineAPI part). ``submit`` and ``cancel`` are for
    callers in the leader's process (the channel streams requests for callers elsewhere); every
    name in :data:`REMOTE_METHODS` can also be called through the local channel."""

    shape: ModelShape

    def submit(self, req: GenerateRequest, sink: Callable[[Event], None]) -> object:
        """Validate (once) and admit ``req``; ``sink`` receives its events from the step thread.
        Returns a handle for :meth:`cancel`. Raises InvalidRequest, QueueFull, Unavailable."""
        ...

    # Any: the handle is whatever this implementation's submit returned (the engine's Sequence)
    def cancel(self, handle: Any) -> None: ...


REMOTE_METHODS = frozenset(
    {
        "placement",
        "plan_placement",
        "apply_placement",
        "migration",
        "wait_migration",
        "abort_migration",
        "expert_load",
        "total_load",
        "total_worker_load",
        "status",
        "slot_digests",
        "router_maps",
        "request_stop",
    }
)
