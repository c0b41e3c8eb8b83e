"""The roles a rank plays in the step loop (``moeserve.dataplane.step``), as the loop sees them.

A rank is a router (attention, gate, shared experts, its KV cache), a worker (expert slots),
or both; rank 0 is also the leader. The step loop drives each role through these interfaces
only, so the data plane imports neither the router, the worker, the engine nor any gRPC code:
``moeserve.router.runner.RouterRunner``, ``moeserve.router.dispatcher.RouterMaps``,
``moeserve.expert_worker.store.ExpertStore`` and ``moeserve.router.engine.leader.Engine`` are the
implementations (tests/test_architecture.py holds the arrows).

Dimension letters: L MoE layers, E logical experts, P slots per MoE layer, W workers, S slots
per worker, K histogram bins, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np
import torch

from moeserve.dataplane.protocol import MoveOp, RankResult, RouterWork, StepHeader

LoadSnapshot = tuple[np.ndarray, np.ndarray, int, np.ndarray, np.ndarray]
"""(logical [L, E], worker [L, W], forward steps, histogram [L, E, K], busy [L, P])."""


class DecodeGraphCounters(Protocol):
    """What the step loop reads of a router's decode graphs to report a slow step."""

    @property
    def captures(self) -> int: ...

    @property
    def seen(self) -> set: ...


class RouterRole(Protocol):
    """A router's share of a step: its sequences through the model, sampled on the device."""

    @property
    def graphs(self) -> DecodeGraphCounters | None:
        """Its decode graphs (None: every step eager)."""
        ...

    def run(self, work: RouterWork, step: int) -> None:
        """Enqueue the step's work (the device may still be running it when this returns)."""
        ...

    def warmup(self, b: int, max_seq_len: int, step: int) -> None:
        """A decode graph warm-up step of bucket ``b`` at start; its load is discarded."""
        ...

    def deliver(self, step: int) -> tuple[int, dict[int, int], dict[int, np.ndarray], dict]:
        """(the step the tokens belong to, sequence id -> token, sequence id -> fp32 logits,
        sequence id -> the PromptLogprobs of its chunk)."""
        ...

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget finished, cancelled or preempted sequences."""
        ...

    def update_grammars(self, add: tuple, drop: tuple[int, ...]) -> None:
        """The header's grammars: (id, GrammarSpec) to compile off the step path, ids to forget."""
        ...

    def grammar_reports(self) -> dict[int, str]:
        """The grammars compiled since the last result: id -> "" (ready) or why not."""
        ...

    def snapshot_load(self) -> None:
        """Start reading the expert load counted on the device since the last snapshot."""
        ...

    def take_load_snapshot(self) -> LoadSnapshot | None:
        """The snapshot started by ``snapshot_load``, once on the host (None: none started)."""
        ...


class RouterMapsRole(Protocol):
    """The placement a router routes with."""

    @property
    def phy2log(self) -> np.ndarray:
        """[L, P] on the host: the maps in force."""
        ...

    @property
    def breakeven(self) -> torch.Tensor:
        """[L, E]: the replica rule's break-even counts in force."""
        ...

    def set_layer(self, layer: int, phy2log_row: Sequence[int], breakeven: Sequence[int] | int = 0) -> None:
        """Switch MoE layer ``layer`` to a committed row of the placement."""
        ...


class WorkerRole(Protocol):
    """A worker's expert slots, their staging buffers and the compute the exchange calls."""

    def begin_staging(self, entries: int) -> str | None:
        """Allocate ``entries`` staging entries; an error message when they do not fit."""
        ...

    def commit(self, layer: int, staged: list[tuple[int, int]], phy2log_row: Sequence[int]) -> None:
        """Copy each staged (slot, entry) into its slot of MoE layer ``layer``."""
        ...

    def end_staging(self) -> None:
        """Free the staging buffers."""
        ...

    def digest(self) -> np.ndarray:
        """float64 [L, S, 2]: (sum, sum of squares) of every slot's weights."""
        ...

    def set_step_pairs(self, pairs: int) -> None:
        """The (token, k) pairs of the coming step over every router (picks the expert kernels)."""
        ...


class LeaderRole(Protocol):
    """Rank 0's engine: it writes every step's header and reads every rank's result."""

    def pace(self) -> None:
        """Before each schedule: wait while the devices are busy and the next step need not be
        enqueued yet (late scheduling, ``moeserve.router.engine.pacing``); returns at once else."""
        ...

    def next_header(self) -> StepHeader:
        """The next step's header (a heartbeat when there is nothing to do)."""
        ...

    def on_results(self, header: StepHeader, results: list[RankResult]) -> None:
        """Every rank's result of the step ``header`` started, in the world's rank order
        (each names its rank of the configuration)."""
        ...

    def request_regroup(self) -> None:
        """A rank waits to join the world: the next header is a regroup."""
        ...


class RunMoves(Protocol):
    """A worker's weight moves of one step (``moeserve.expert_worker.migration.run_moves``)."""

    def __call__(self, moves: Sequence[MoveOp]) -> object: ...
