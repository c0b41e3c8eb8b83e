"""Live migration on the leader: from an applied placement to weight moves in step headers.

Dimension letters: L MoE layers, P physical slots per MoE layer, W workers.

The leader owns the placement in force (per-layer maps and versions). ``plan`` validates a
new phy2log and diffs it into moves; ``Migrator`` turns a plan into the migration part of
successive step headers (docs/dataplane.md, "Migration"):

  begin (workers allocate staging) -> moves of one layer at a time, under a byte budget per
  destination worker per step -> commit of that layer in the header after its last moves
  landed -> ... -> the last commit, with ``end`` (staging freed).

Abort, a superseding plan and a staging failure roll back the uncommitted layers and give
the state in force a fresh version. Only the step driver calls ``header_ops`` and
``on_step_done``; other threads call ``start``, ``abort`` and the read-only queries, all
under one lock.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from dataclasses import dataclass, field

import numpy as np

from moeserve.dataplane.protocol import LayerCommit, MigrationOps, MoveOp
from moeserve.placement import MigrationProgress, MigrationState, Placement
from moeserve.router.engine.api import InvalidRequest, StaleVersion


@dataclass
class Migration:
    """A migration's plan and progress (mutable, under the Migrator's lock; callers get
    :meth:`progress` snapshots). ``state``: planned -> staging -> moving -> done, or aborted /
    failed (with ``error``)."""

    id: str
    target: np.ndarray  # [L, P] the phy2log asked for
    target_breakeven: np.ndarray  # [L, E] its break-even counts b
    target_version: int
    moves: dict[int, list[MoveOp]]  # per MoE layer to commit, in layer order (empty: only b changes)
    total_moves: int
    total_bytes: int
    staging_slots: int
    state: MigrationState = MigrationState.PLANNED
    error: str = ""
    moves_done: int = 0
    bytes_done: int = 0
    layers_committed: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def progress(self) -> MigrationProgress:
        return MigrationProgress(
            self.id,
            self.state,
            self.error,
            self.target_version,
            self.total_moves,
            self.moves_done,
            self.total_bytes,
            self.bytes_done,
            len(self.moves),
            len(self.layers_committed),
        )


class Migrator:
    """The placement in force and at most one running migration.

    placement:       the initial Placement (version and per-layer versions included).
    expert_bytes:    bytes of one expert's weights.
    bytes_per_step:  byte budget per destination worker per step (at least one move per step
                     is always scheduled, so an expert larger than the budget still moves).
    """

    def __init__(self, placement: Placement, expert_bytes: int, bytes_per_step: int):
        self._lock = threading.Lock()
        self.current = placement
        self.expert_bytes = expert_bytes
        self.bytes_per_step = bytes_per_step
        self._versions = itertools.count(int(placement.version) + 1)
        self.active: Migration | None = None
        self.history: dict[str, Migration] = {}
        self._abort_pending: Migration | None = None  # aborted: its rollback goes in the next header
        self._layer_idx = 0  # index into active.moves' layers
        self._move_idx = 0  # next move of that layer
        self._awaiting_commit: int | None = None  # layer whose moves all went out last step

    # -- any thread --------------------------------------------------------------------------

    def placement(self) -> Placement:
        with self._lock:
            return self.current

    def plan(self, target: np.ndarray | Placement, expected_version: int | None = None) -> Migration:
        """Diff ``target`` against the placement in force. ``target`` is a phy2log [L, P], which
        is validated here (InvalidRequest says what is wrong) and keeps the break-even counts in
        force, or a Placement the caller built for this cluster's topology (validated when it
        was built: a placement is validated once between a front door and the workers), whose
        ``breakeven`` [L, E] then takes effect with it. A layer whose b changes is committed
        too, with or without moves. Raises StaleVersion too."""
        with self._lock:
            cur = self.current
            if expected_version is not None and int(expected_version) != int(cur.version):
                raise StaleVersion(
                    f"expected placement version {expected_version}, but version {cur.version} is in force"
                )
            try:
                if isinstance(target, Placement):
                    new = target
                else:
                    phy2log = np.asarray(target)
                    if phy2log.shape != cur.phy2log.shape:
                        raise ValueError(
                            f"phy2log has shape {phy2log.shape}, expected (MoE layers, slots) = {cur.phy2log.shape}"
                        )
                    new = Placement(
                        phy2log=phy2log,
                        num_logical=cur.num_logical,
                        num_workers=cur.num_workers,
                        workers_per_node=cur.workers_per_node,
                        version=cur.version,
                        breakeven=cur.breakeven,
                    )
                assert new.breakeven is not None and cur.breakeven is not None  # Placement fills them
                if new.breakeven.shape != cur.breakeven.shape:
                    raise ValueError(
                        f"breakeven must have shape (L, E) = {cur.breakeven.shape}, got {new.breakeven.shape}"
                    )
                diff = cur.diff(new, self.expert_bytes)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            s = cur.phy2log.shape[1] // cur.num_workers
            moves: dict[int, list[MoveOp]] = {}
            inflow = np.zeros((cur.phy2log.shape[0], cur.num_workers), dtype=np.int64)
            # Per layer, moves go out grouped by (destination, source) and each destination's
            # staging entries are numbered in that order, so the moves between one pair of
            # workers in one step fill consecutive staging entries: one transfer per pair.
            for m in sorted(diff, key=lambda m: (m.moe_layer, m.dst_worker, m.src_worker, m.slot)):
                src_slot = _slot_of(cur.phy2log[m.moe_layer], m.logical, m.src_worker, s)
                stage = int(inflow[m.moe_layer, m.dst_worker])
                inflow[m.moe_layer, m.dst_worker] += 1
                moves.setdefault(m.moe_layer, []).append(
                    MoveOp(
                        moe_layer=m.moe_layer,
                        slot=m.slot,
                        logical=m.logical,
                        src_worker=m.src_worker,
                        src_slot=src_slot,
                        dst_worker=m.dst_worker,
                        stage=stage,
                    )
                )
            for layer in np.flatnonzero((new.breakeven != cur.breakeven).any(1)).tolist():
                moves.setdefault(int(layer), [])  # b changes: committed, with no moves of its own
            moves = dict(sorted(moves.items()))
            return Migration(
                id=uuid.uuid4().hex[:12],
                target=new.phy2log.copy(),
                target_breakeven=np.array(new.breakeven, dtype=np.int64),
                target_version=-1,
                moves=moves,
                total_moves=len(diff),
                total_bytes=len(diff) * self.expert_bytes,
                staging_slots=int(inflow.max()) if diff else 0,
            )

    def start(self, mig: Migration, expected_version: int | None = None) -> Migration:
        """Make ``mig`` (from ``plan``) the running migration, aborting one that runs."""
        with self._lock:
            if expected_version is not None and int(expected_version) != int(self.current.version):
                raise StaleVersion(
                    f"expected placement version {expected_version}, but version {self.current.version} is in force"
                )
            if self.active is not None:
                self._abort_locked("superseded by migration " + mig.id)
            mig.target_version = next(self._versions)
            self.history[mig.id] = mig
            if not mig.moves:  # nothing changes: done at once, same state
                mig.state = MigrationState.DONE
                mig.target_version = int(self.current.version)
                mig.done.set()
                return mig
            if mig.total_moves == 0:  # only b changes: no staging, commits only
                mig.state = MigrationState.MOVING
            self.active = mig
            self._layer_idx = self._move_idx = 0
            self._awaiting_commit = None
            return mig

    def abort(self, reason: str = "aborted") -> bool:
        with self._lock:
            if self.active is None:
                return False
            self._abort_locked(reason)
            return True

    def get(self, migration_id: str) -> Migration | None:
        with self._lock:
            return self.history.get(migration_id)

    def active_progress(self) -> MigrationProgress | None:
        with self._lock:
            return self.active.progress() if self.active is not None else None

    def moved_totals(self) -> tuple[int, int, dict[str, int]]:
        """What migrations moved since start: (slots, bytes) sent (moves are counted when
        scheduled into a header; they land at the end of that step), and the number of ended
        migrations per state name (done, aborted, failed)."""
        with self._lock:
            migs = list(self.history.values())
        results: dict[str, int] = {}
        for m in migs:
            if m.done.is_set():
                results[str(m.state)] = results.get(str(m.state), 0) + 1
        return sum(m.moves_done for m in migs), sum(m.bytes_done for m in migs), results

    # -- step driver ------------------------------------------------------------------------

    def header_ops(self) -> MigrationOps | None:
        """The migration work of the next step (None when there is none)."""
        with self._lock:
            if self._abort_pending is not None:
                aborted, self._abort_pending = self._abort_pending, None
                return MigrationOps(aborted.id, rollback=True, end=True)
            mig = self.active
            if mig is None:
                return None
            if mig.state == MigrationState.PLANNED:
                mig.state = MigrationState.STAGING
                return MigrationOps(mig.id, begin_staging_slots=mig.staging_slots)
            if mig.state == MigrationState.STAGING:
                return None  # waiting for the staging report
            commits: list[LayerCommit] = []
            layers = list(mig.moves)
            if self._awaiting_commit is not None:
                layer = self._awaiting_commit
                commits.append(self._commit_op(mig, layer))
                self._commit_locked(layer)
                self._awaiting_commit = None
                self._layer_idx += 1
                self._move_idx = 0
            while self._layer_idx < len(layers) and not mig.moves[layers[self._layer_idx]]:
                layer = layers[self._layer_idx]  # only b changes: nothing to wait for
                commits.append(self._commit_op(mig, layer))
                self._commit_locked(layer)
                self._layer_idx += 1
            if self._layer_idx >= len(layers):
                self._finish_locked()
                return MigrationOps(mig.id, commits=tuple(commits), end=True)
            layer = layers[self._layer_idx]
            todo = mig.moves[layer]
            sent = np.zeros(self.current.num_workers, dtype=np.int64)
            batch: list[MoveOp] = []
            while self._move_idx < len(todo):
                m = todo[self._move_idx]
                if batch and sent[m.dst_worker] + self.expert_bytes > self.bytes_per_step:
                    break
                sent[m.dst_worker] += self.expert_bytes
                batch.append(m)
                self._move_idx += 1
            if self._move_idx >= len(todo):
                self._awaiting_commit = layer
            mig.moves_done += len(batch)
            mig.bytes_done += len(batch) * self.expert_bytes
            return MigrationOps(mig.id, commits=tuple(commits), moves=tuple(batch))

    def on_staging(self, migration_id: str, errors: list[str]) -> None:
        """The workers' report after ``begin``: roll back when any could not allocate."""
        with self._lock:
            mig = self.active
            if mig is None or mig.id != migration_id or mig.state != MigrationState.STAGING:
                return
            if errors:
                mig.error = "; ".join(errors)
                self._abort_locked(mig.error, state=MigrationState.FAILED)
            else:
                mig.state = MigrationState.MOVING

    # -- internals (lock held) ---------------------------------------------------------------

    @staticmethod
    def _commit_op(mig: Migration, layer: int) -> LayerCommit:
        return LayerCommit(
            moe_layer=layer,
            phy2log=tuple(int(x) for x in mig.target[layer]),
            version=mig.target_version,
            staged=tuple((m.slot, m.stage) for m in mig.moves[layer]),
            breakeven=tuple(int(x) for x in mig.target_breakeven[layer]),
        )

    def _commit_locked(self, layer: int) -> None:
        mig = self.active
        assert mig is not None  # called for the running migration
        p2l = self.current.phy2log.copy()
        p2l[layer] = mig.target[layer]
        lv = np.array(self.current.layer_versions, dtype=np.int64).copy()
        lv[layer] = mig.target_version
        b = np.array(self.current.breakeven, dtype=np.int64)
        b[layer] = mig.target_breakeven[layer]
        self.current = self.current.evolve(phy2log=p2l, layer_versions=lv, breakeven=b)  # rows of a validated target
        mig.layers_committed.append(layer)

    def _finish_locked(self) -> None:
        mig = self.active
        assert mig is not None  # called for the running migration
        lv = np.full_like(np.asarray(self.current.layer_versions, dtype=np.int64), mig.target_version)
        self.current = self.current.evolve(version=mig.target_version, layer_versions=lv)
        mig.state = MigrationState.DONE
        self.active = None
        mig.done.set()

    def _abort_locked(self, reason: str, state: MigrationState = MigrationState.ABORTED) -> None:
        mig = self.active
        assert mig is not None  # called for the running migration
        self.active = None
        mig.state = state
        mig.error = reason
        # The state in force (committed layers new, the others old) is a state of its own.
        self.current = self.current.evolve(version=next(self._versions))
        self._abort_pending = mig
        mig.done.set()


def _slot_of(row: np.ndarray, logical: int, worker: int, slots_per_worker: int) -> int:
    """A global slot of ``worker`` holding ``logical`` in the phy2log row [P]."""
    lo = worker * slots_per_worker
    hits = np.nonzero(row[lo : lo + slots_per_worker] == logical)[0]
    if hits.size == 0:
        raise AssertionError(f"worker {worker} does not hold logical expert {logical}")
    return int(lo + hits[0])
