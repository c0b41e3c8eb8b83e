"""The placement of logical experts on physical slots, shared by the data plane and the balancer.

Dimension letters: L MoE layers, E logical experts, P physical slots per layer, W expert workers,
S = P / W slots per worker, N nodes, X the width of ``log2phy`` (fixed by the caller, e.g. R + 1).

Glossary (CONTRIBUTING.md): slot ``p`` lives on worker ``p // S``; workers ``n * wpn .. (n+1) * wpn - 1``
form node ``n`` (``wpn`` = workers per node). A placement is ``phy2log [L, P]``; every logical
expert has at least one replica in every layer. A logical expert's load splits evenly over its
replicas (the data plane's replica choice is a deterministic even spread), so a worker's load is
the sum over its slots of ``load[e] / logcnt[e]``.

Numpy only; torch is imported lazily and only to read SGLang ``.pt`` files.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "Placement",
    "check_breakeven",
    "Move",
    "MigrationState",
    "MigrationProgress",
    "balancedness",
    "log2phy",
    "model_balancedness",
    "worker_load",
    "logical_counts",
    "load_from_sglang",
    "FORMAT",
]

FORMAT = "moeserve.placement/1"


def logical_counts(phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """Replica count of every logical expert: ``phy2log [L, P]`` -> ``logcnt [L, E]`` int64."""
    phy2log = np.asarray(phy2log)
    layers = phy2log.shape[0]
    flat = (phy2log + (np.arange(layers) * num_logical)[:, None]).ravel()
    return np.bincount(flat, minlength=layers * num_logical).reshape(layers, num_logical)


def log2phy(phy2log: np.ndarray, num_logical: int, max_replicas: int) -> np.ndarray:
    """Slots of every logical expert, ascending, padded with -1: ``phy2log [L, P]`` ->
    ``log2phy [L, E, X]`` int64, X = ``max_replicas``. ValueError when an expert has more than X
    replicas. Replica j of expert e is the j-th slot holding e (the data plane's replica rule
    counts on that order)."""
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, p = phy2log.shape
    cnt = logical_counts(phy2log, num_logical)
    if cnt.max(initial=0) > max_replicas:
        l, e = map(int, np.argwhere(cnt > max_replicas)[0])
        raise ValueError(
            f"layer {l}: logical expert {e} has {int(cnt[l, e])} replicas, "
            f"more than the table width max_replicas={max_replicas}"
        )
    key = phy2log + (np.arange(layers) * num_logical)[:, None]  # [L, P] (layer, expert)
    order = np.argsort(key, axis=None, kind="stable")  # slots grouped by key
    sorted_key = key.ravel()[order]
    first = np.searchsorted(sorted_key, sorted_key, side="left")
    rank = np.arange(order.size) - first  # replica rank
    out = np.full((layers * num_logical, max_replicas), -1, dtype=np.int64)
    out[sorted_key, rank] = order % p
    return out.reshape(layers, num_logical, max_replicas)


def worker_load(load: np.ndarray, phy2log: np.ndarray, num_workers: int) -> np.ndarray:
    """Load of every worker: ``load [L, E]``, ``phy2log [L, P]`` -> ``[L, W]`` float64.

    A logical expert's load splits evenly over its replicas; a worker's load is the sum over
    its ``P / W`` consecutive slots.
    """
    load = np.asarray(load, dtype=np.float64)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    layers, num_logical = load.shape
    p = phy2log.shape[1]
    if phy2log.shape[0] != layers:
        raise ValueError(f"load has {layers} layers but phy2log has {phy2log.shape[0]}")
    if p % num_workers:
        raise ValueError(f"{p} slots do not split evenly over {num_workers} workers")
    cnt = logical_counts(phy2log, num_logical)
    idx = phy2log + (np.arange(layers) * num_logical)[:, None]
    per_slot = load.ravel()[idx] / np.maximum(cnt.ravel()[idx], 1)  # [L, P]
    return per_slot.reshape(layers, num_workers, p // num_workers).sum(2)


def balancedness(load: np.ndarray, phy2log: np.ndarray, num_workers: int) -> np.ndarray:
    """Balancedness of every layer, mean worker load / max worker load: -> ``[L]`` in (0, 1].

    A layer with no tokens counts 1.0. ``load [L, E]``, ``phy2log [L, P]``.
    """
    return worker_balancedness(worker_load(load, phy2log, num_workers))["per_layer"]


def model_balancedness(load: np.ndarray, phy2log: np.ndarray, num_workers: int) -> dict[str, float]:
    """The model's balancedness two ways.

    ``mean``: the mean over layers with tokens of the per-layer balancedness (this project's and
    the yardstick's figure; 1.0 when no layer has tokens). ``sum_ratio``: sum over layers of the
    mean worker load / sum over layers of the max worker load (what vLLM logs).
    """
    b = worker_balancedness(worker_load(load, phy2log, num_workers))
    return {"mean": b["mean"], "sum_ratio": b["sum_ratio"]}


def worker_balancedness(worker_load_: np.ndarray) -> dict:
    """From worker loads ``[L, W]`` (predicted, or measured by the routers): ``per_layer`` [L]
    mean/max (1.0 for a layer without tokens), ``mean`` over the layers with tokens, and vLLM's
    ``sum_ratio`` (sum of means / sum of maxes); both 1.0 when no layer has tokens."""
    wl = np.asarray(worker_load_, dtype=np.float64)
    peak = wl.max(1)
    busy = peak > 0
    per_layer = np.ones(wl.shape[0])
    per_layer[busy] = wl.mean(1)[busy] / peak[busy]
    mean = float(per_layer[busy].mean()) if busy.any() else 1.0
    sum_ratio = float(wl.mean(1).sum() / peak.sum()) if busy.any() else 1.0
    return {"per_layer": per_layer, "mean": mean, "sum_ratio": sum_ratio}


class MigrationState(enum.StrEnum):
    """Where a live migration is: planned -> staging -> moving -> done, or aborted / failed.
    A str (``MigrationState.DONE == "done"``); ``moeserve.wire`` maps it to the wire's enum."""

    PLANNED = "planned"
    STAGING = "staging"
    MOVING = "moving"
    DONE = "done"
    ABORTED = "aborted"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        return self in (MigrationState.DONE, MigrationState.ABORTED, MigrationState.FAILED)


@dataclass(frozen=True)
class MigrationProgress:
    """A snapshot of one live migration, as the engine, the wire and the SDK see it."""

    migration_id: str
    state: MigrationState
    error: str
    target_version: int
    moves_total: int
    moves_done: int
    bytes_total: int
    bytes_done: int
    layers_total: int
    layers_committed: int

    @property
    def ended(self) -> bool:
        return self.state.ended


@dataclass(frozen=True)
class Move:
    """One slot taking a new logical expert: its weights come from ``src_worker``.

    ``src_worker == dst_worker`` is a copy inside one worker (no bytes on the wire).
    """

    moe_layer: int
    slot: int
    logical: int
    src_worker: int
    dst_worker: int
    nbytes: int

    @property
    def local(self) -> bool:
        return self.src_worker == self.dst_worker


def check_breakeven(breakeven, num_layers: int, num_logical: int) -> np.ndarray:
    """The break-even counts b of a placement as int64 ``[L, E]`` (None: zeros, every replica
    always used); ValueError naming the shape expected when ``breakeven`` has another shape, or
    holds a negative or non-integer count."""
    if breakeven is None:
        return np.zeros((num_layers, num_logical), dtype=np.int64)
    b = np.asarray(breakeven)
    if b.shape != (num_layers, num_logical):
        raise ValueError(
            f"breakeven must have shape (L, E) = ({num_layers}, {num_logical}) (one break-even count "
            f"per MoE layer and logical expert), got shape {b.shape}"
        )
    if b.size and not np.issubdtype(b.dtype, np.integer):
        if not np.issubdtype(b.dtype, np.number) or not np.isfinite(b).all() or not np.all(np.mod(b, 1) == 0):
            raise ValueError(f"breakeven must hold integer counts of tokens, got dtype {b.dtype}")
    b = b.astype(np.int64, copy=True)
    if (b < 0).any():
        l, x = map(int, np.argwhere(b < 0)[0])
        raise ValueError(
            f"breakeven counts must be >= 0 (0 = every replica always used); layer {l} expert {x} has {int(b[l, x])}"
        )
    return b


def _as_int_matrix(a: Any, what: str) -> np.ndarray:
    arr = np.asarray(a)
    if arr.ndim != 2:
        raise ValueError(f"{what} must be 2-D [layers, slots], got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"{what} must hold integer logical expert ids, got dtype {arr.dtype}")
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Placement:
    """Which logical expert every physical slot holds, per MoE layer, and its version.

    phy2log: [L, P] int64, logical expert id of every slot.
    num_logical: E (explicit: the largest id in use says nothing about E).
    num_workers: W, ``P % W == 0``; slot ``p`` lives on worker ``p // (P / W)``.
    workers_per_node: consecutive workers per node (``W % workers_per_node == 0``); None = one node.
    version: the placement's version; layer_versions [L]: the version each layer was last
    committed at. The data plane commits a migration layer by layer, so while one runs the
    committed layers carry the target version, ahead of ``version``.
    breakeven: [L, E] int64, the break-even counts b of the data plane's replica rule
    (docs/eplb.md; 0, the default: every replica always used); None means zeros.
    Arrays are copied and made read-only.
    """

    phy2log: np.ndarray
    num_logical: int
    num_workers: int
    workers_per_node: int | None = None
    version: int = 0
    layer_versions: np.ndarray | None = field(default=None)
    breakeven: np.ndarray | None = field(default=None)

    def __post_init__(self):
        p2l = _as_int_matrix(self.phy2log, "phy2log").copy()
        layers, p = p2l.shape
        e, w = self.num_logical, self.num_workers
        for name, v in (("num_logical", e), ("num_workers", w)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        wpn = w if self.workers_per_node is None else self.workers_per_node
        if not isinstance(wpn, (int, np.integer)) or wpn < 1:
            raise ValueError(f"workers_per_node must be a positive integer, got {wpn!r}")
        if p == 0 or p % w:
            raise ValueError(
                f"{p} slots per layer do not split evenly over {w} workers (P must be a positive multiple of W)"
            )
        if w % wpn:
            raise ValueError(f"{w} workers do not split into nodes of {wpn} (W must be a multiple of workers_per_node)")
        if p < e:
            raise ValueError(f"{p} slots cannot hold {e} logical experts (P must be at least E)")
        bad = (p2l < 0) | (p2l >= e)
        if bad.any():
            l, s = map(int, np.argwhere(bad)[0])
            raise ValueError(f"layer {l} slot {s}: logical expert id {int(p2l[l, s])} is out of range 0..{e - 1}")
        missing = logical_counts(p2l, e) == 0
        if missing.any():
            l, x = map(int, np.argwhere(missing)[0])
            raise ValueError(f"layer {l}: logical expert {x} has no replica (every logical expert needs one)")
        if not isinstance(self.version, (int, np.integer)) or self.version < 0:
            raise ValueError(f"version must be a non-negative integer, got {self.version!r}")
        lv = (
            np.full(layers, self.version, dtype=np.int64)
            if self.layer_versions is None
            else np.asarray(self.layer_versions).astype(np.int64, copy=True)
        )
        if lv.shape != (layers,):
            raise ValueError(f"layer_versions must have shape ({layers},), got {lv.shape}")
        if (lv < 0).any():
            raise ValueError(f"layer_versions must be non-negative, got {lv.min()}")
        b = check_breakeven(self.breakeven, layers, e)
        p2l.setflags(write=False)
        lv.setflags(write=False)
        b.setflags(write=False)
        object.__setattr__(self, "breakeven", b)
        object.__setattr__(self, "phy2log", p2l)
        object.__setattr__(self, "workers_per_node", int(wpn))
        object.__setattr__(self, "layer_versions", lv)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        # __post_init__ fills layer_versions and breakeven
        assert self.layer_versions is not None and self.breakeven is not None
        assert other.layer_versions is not None and other.breakeven is not None
        return (
            (self.num_logical, self.num_workers, self.workers_per_node, self.version)
            == (other.num_logical, other.num_workers, other.workers_per_node, other.version)
            and np.array_equal(self.phy2log, other.phy2log)
            and np.array_equal(self.layer_versions, other.layer_versions)
            and np.array_equal(self.breakeven, other.breakeven)
        )

    # No __hash__: a class that defines __eq__ alone has __hash__ None (mutable-looking arrays
    # inside: not hashable), and dataclass(eq=False) leaves it so.

    # ---- shape -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_worker(self) -> int:
        return self.num_slots // self.num_workers

    @property
    def num_nodes(self) -> int:
        assert self.workers_per_node is not None  # __post_init__ fills it
        return self.num_workers // self.workers_per_node

    def worker_of_slot(self, slot):
        """Worker of a slot (int or int array)."""
        return np.asarray(slot) // self.slots_per_worker if not isinstance(slot, int) else slot // self.slots_per_worker

    def node_of_worker(self, worker):
        """Node of a worker (int or int array)."""
        assert self.workers_per_node is not None  # __post_init__ fills it
        return (
            np.asarray(worker) // self.workers_per_node
            if not isinstance(worker, int)
            else worker // self.workers_per_node
        )

    def node_of_slot(self, slot):
        return self.node_of_worker(self.worker_of_slot(slot))

    # ---- derived tables --------------------------------------------------------------------
    def logcnt(self) -> np.ndarray:
        """Replica count of every logical expert: [L, E] int64."""
        return logical_counts(self.phy2log, self.num_logical)

    def log2phy(self, max_replicas: int) -> np.ndarray:
        """Slots of every logical expert, ascending, padded with -1: [L, E, X] int64, X = ``max_replicas``.

        X is fixed by the caller (R + 1 at startup) so that tables never change shape; an
        expert with more replicas than X is an error.
        """
        return log2phy(self.phy2log, self.num_logical, max_replicas)

    def worker_load(self, load: np.ndarray) -> np.ndarray:
        """[L, W] load of every worker under ``load [L, E]``."""
        self._check_load(load)
        return worker_load(load, self.phy2log, self.num_workers)

    def balancedness(self, load: np.ndarray) -> np.ndarray:
        """[L] balancedness of every layer under ``load [L, E]``."""
        self._check_load(load)
        return balancedness(load, self.phy2log, self.num_workers)

    def _check_load(self, load) -> None:
        shape = np.shape(load)
        if shape != (self.num_layers, self.num_logical):
            raise ValueError(f"load has shape {shape}, expected {(self.num_layers, self.num_logical)}")

    # ---- changes ---------------------------------------------------------------------------
    def evolve(
        self,
        *,
        phy2log: np.ndarray | None = None,
        version: int | None = None,
        layer_versions: np.ndarray | None = None,
        breakeven: np.ndarray | None = None,
    ) -> Placement:
        """This placement with some fields replaced, *without* validating again: for the engine,
        whose new maps come row by row from a placement it validated already (a migration's
        target), so a per-layer commit costs no second validation."""
        new = object.__new__(Placement)
        for name, value in (
            ("phy2log", self.phy2log if phy2log is None else phy2log),
            ("layer_versions", self.layer_versions if layer_versions is None else layer_versions),
            ("breakeven", self.breakeven if breakeven is None else breakeven),
        ):
            arr = np.array(value, dtype=np.int64)
            arr.setflags(write=False)
            object.__setattr__(new, name, arr)
        for name in ("num_logical", "num_workers", "workers_per_node"):
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "version", self.version if version is None else int(version))
        return new

    def replace(self, phy2log: np.ndarray, version: int | None = None, breakeven=None) -> Placement:
        """A placement with the same shape and topology, new maps and (by default) version + 1;
        ``breakeven`` None keeps this placement's break-even counts."""
        v = self.version + 1 if version is None else version
        b = self.breakeven if breakeven is None else breakeven
        return Placement(phy2log, self.num_logical, self.num_workers, self.workers_per_node, v, breakeven=b)

    def diff(self, new: Placement, expert_bytes: int) -> list[Move]:
        """The moves that turn this placement into ``new``: one per slot whose logical expert changes.

        The source of a move is a worker that holds the logical expert in *this* (the old)
        placement: the destination worker itself if it holds one (a local copy), else one on
        the destination's node, else the holder with the fewest sends so far (ties: the lowest
        worker id), so that sends spread over the holders. ``expert_bytes``: bytes of one
        expert's weights. Moves come in (layer, slot) order.
        """
        if (new.num_layers, new.num_slots, new.num_logical, new.num_workers, new.workers_per_node) != (
            self.num_layers,
            self.num_slots,
            self.num_logical,
            self.num_workers,
            self.workers_per_node,
        ):
            raise ValueError(
                "the two placements differ in shape or topology: "
                f"{(self.num_layers, self.num_slots, self.num_logical, self.num_workers, self.workers_per_node)} "
                f"vs {(new.num_layers, new.num_slots, new.num_logical, new.num_workers, new.workers_per_node)} "
                "(layers, slots, logical experts, workers, workers per node)"
            )
        if expert_bytes < 0:
            raise ValueError(f"expert_bytes must be >= 0, got {expert_bytes}")
        s, wpn = self.slots_per_worker, self.workers_per_node
        assert wpn is not None  # __post_init__ fills it
        layers, p = self.phy2log.shape
        worker = np.arange(p) // s
        # held[l, w, x]: worker w holds logical expert x in layer l (old placement)
        held = np.zeros((layers, self.num_workers, self.num_logical), dtype=bool)
        held[np.arange(layers)[:, None], worker, self.phy2log] = True
        ls, ps = np.nonzero(self.phy2log != new.phy2log)  # (layer, slot) order
        xs = new.phy2log[ls, ps]
        ds = ps // s
        local = held[ls, ds, xs]
        holders: dict[tuple[int, int], list[int]] = {}
        sends = np.zeros((layers, self.num_workers), dtype=np.int64).tolist()
        moves: list[Move] = []
        nbytes = int(expert_bytes)
        for l, slot, x, dst, here in zip(ls.tolist(), ps.tolist(), xs.tolist(), ds.tolist(), local.tolist()):
            if here:
                src = dst
            else:
                cand = holders.get((l, x))
                if cand is None:
                    cand = holders[(l, x)] = np.flatnonzero(held[l, :, x]).tolist()
                near = [h for h in cand if h // wpn == dst // wpn]
                sl = sends[l]
                src = min(near or cand, key=lambda h: (sl[h], h))
                sl[src] += 1
            moves.append(Move(l, slot, x, src, dst, nbytes))
        return moves

    # ---- files -----------------------------------------------------------------------------
    def to_json(self) -> str:
        assert self.layer_versions is not None and self.breakeven is not None  # __post_init__ fills them
        return json.dumps(
            {
                "format": FORMAT,
                "num_logical": self.num_logical,
                "num_workers": self.num_workers,
                "workers_per_node": self.workers_per_node,
                "version": self.version,
                "layer_versions": self.layer_versions.tolist(),
                "phy2log": self.phy2log.tolist(),
                "breakeven": self.breakeven.tolist(),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Placement:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not a placement: invalid JSON ({exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f'not a placement: expected a JSON object with "format": "{FORMAT}"')
        missing = {"phy2log", "num_logical", "num_workers"} - set(d)
        if missing:
            raise ValueError(f"placement JSON lacks {sorted(missing)}")
        return cls(
            np.asarray(d["phy2log"], dtype=np.int64),
            int(d["num_logical"]),
            int(d["num_workers"]),
            d.get("workers_per_node"),
            int(d.get("version", 0)),
            d.get("layer_versions"),
            d.get("breakeven"),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Placement:
        return cls.from_json(Path(path).read_text())

    @classmethod
    def from_sglang(
        cls,
        path: str | Path,
        moe_layer_ids: Sequence[int],
        num_logical: int,
        num_workers: int,
        workers_per_node: int | None = None,
        num_decoder_layers: int | None = None,
        version: int = 0,
    ) -> Placement:
        """Read an SGLang expert-location file holding ``physical_to_logical_map``.

        SGLang (``--init-expert-location``) indexes its map by *decoder* layer, dense layers
        included: ``[num_decoder_layers, P]``, as JSON or a ``torch.save`` dict (.pt). The rows
        at ``moe_layer_ids`` become MoE layers ``0 .. L-1`` and are fully validated. SGLang
        writes a full map for dense rows too (its trivial ``p % E`` map, or a plan computed on
        their all-zero counts), so a dense row cannot be told from a MoE row by its content;
        what is checked is that every dense row has the same width and holds only ids in
        ``-1 .. E-1``, and (with ``num_decoder_layers``) that the file has that many rows.
        A file with ``logical_count`` holds load, not a placement: see :func:`load_from_sglang`.
        """
        data = _read_sglang(path)
        if "physical_to_logical_map" not in data:
            if "logical_count" in data:
                raise ValueError(
                    f"{path} holds logical_count (load), not a placement: read it with "
                    "load_from_sglang() and compute a placement with a policy"
                )
            raise ValueError(f"{path} has neither physical_to_logical_map nor logical_count (keys: {sorted(data)})")
        table = _as_int_matrix(_to_numpy(data["physical_to_logical_map"]), "physical_to_logical_map")
        ids = _check_layer_ids(moe_layer_ids, table.shape[0], num_decoder_layers, path)
        dense = np.setdiff1d(np.arange(table.shape[0]), ids)
        bad = (table[dense] < -1) | (table[dense] >= num_logical)
        if bad.any():
            l, s = np.argwhere(bad)[0]
            raise ValueError(
                f"{path}: dense decoder layer {int(dense[l])} slot {int(s)} holds "
                f"{int(table[dense[l], s])}, not an id in -1..{num_logical - 1}"
            )
        try:
            return cls(table[ids], num_logical, num_workers, workers_per_node, version)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc} (MoE layer index; decoder layers {ids.tolist()})") from None


def _to_numpy(v) -> np.ndarray:
    if type(v).__module__.startswith("torch"):
        return v.detach().cpu().numpy()
    return np.asarray(v)


def _read_sglang(path) -> dict:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"no such file: {path}")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON ({exc})") from None
    elif path.suffix == ".pt":
        import torch  # only to read SGLang's torch.save files

        data = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"{path}: unknown SGLang expert-location file type {path.suffix!r} (allowed: .json, .pt)")
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: expected a dict with physical_to_logical_map or logical_count, got {type(data).__name__}"
        )
    return data


def _check_layer_ids(moe_layer_ids, rows: int, num_decoder_layers, path) -> np.ndarray:
    ids = np.asarray(list(moe_layer_ids), dtype=np.int64)
    if ids.size == 0:
        raise ValueError("moe_layer_ids is empty: give the decoder-layer index of every MoE layer")
    if len(np.unique(ids)) != ids.size or (np.diff(ids) <= 0).any():
        raise ValueError(f"moe_layer_ids must be strictly increasing decoder-layer indices, got {ids.tolist()}")
    if num_decoder_layers is not None and rows != num_decoder_layers:
        raise ValueError(f"{path} has {rows} decoder layers, expected num_decoder_layers={num_decoder_layers}")
    if ids[0] < 0 or ids[-1] >= rows:
        raise ValueError(
            f"{path} has {rows} decoder layers; moe_layer_ids must lie in 0..{rows - 1}, got {ids.tolist()}"
        )
    return ids


def load_from_sglang(
    path: str | Path,
    moe_layer_ids: Sequence[int],
    num_logical: int | None = None,
    num_decoder_layers: int | None = None,
) -> np.ndarray:
    """Read the load in an SGLang ``logical_count`` file: -> ``[L, E]`` float64, MoE layers only.

    SGLang's expert-distribution dump holds ``logical_count`` ``[..., num_decoder_layers, E]``
    (a leading buffer dimension of steps; any leading dimensions are summed). SGLang records
    nothing for dense layers, so every dense row must be all zero: a non-zero dense row means
    ``moe_layer_ids`` does not match the model and is an error naming the decoder layer.
    Compute a placement from the result with a policy (:mod:`moeserve.balancer.policy`).
    """
    data = _read_sglang(path)
    if "logical_count" not in data:
        raise ValueError(f"{path} has no logical_count (keys: {sorted(data)})")
    cnt = _to_numpy(data["logical_count"]).astype(np.float64)
    if cnt.ndim < 2:
        raise ValueError(f"{path}: logical_count must have at least 2 dims [..., layers, experts], got {cnt.shape}")
    cnt = cnt.reshape(-1, *cnt.shape[-2:]).sum(0)  # [D, E]
    if num_logical is not None and cnt.shape[1] != num_logical:
        raise ValueError(f"{path}: logical_count has {cnt.shape[1]} experts, expected {num_logical}")
    if not np.isfinite(cnt).all() or (cnt < 0).any():
        raise ValueError(f"{path}: logical_count must be finite and non-negative")
    ids = _check_layer_ids(moe_layer_ids, cnt.shape[0], num_decoder_layers, path)
    dense = np.setdiff1d(np.arange(cnt.shape[0]), ids)
    busy = dense[cnt[dense].sum(1) > 0]
    if busy.size:
        raise ValueError(
            f"{path}: decoder layer {int(busy[0])} is not in moe_layer_ids but has "
            f"{cnt[busy[0]].sum():g} routed tokens; moe_layer_ids={ids.tolist()} does not match the model"
        )
    return cnt[ids]
