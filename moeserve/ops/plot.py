"""Pictures of expert load: ``moeserve load --plot FILE.png`` (matplotlib, the ``plot`` extra).

Dimension letters: L MoE layers, E logical experts, P physical slots, W workers.

One column per load dump (two dumps: before and after a rebalance, side by side):

- top: the load of every logical expert per MoE layer (heatmap, each layer's share of its
  pairs, so layers of different traffic read alike);
- bottom, when the dump carries the placement: the load of every physical slot, the expert's
  load split evenly over its replicas (the rule the data plane follows), slots grouped by
  worker, each cell labelled with the logical expert it holds, and each layer's balancedness
  (mean worker load / max worker load) at the right. Replicas that stayed idle over the window
  (their expert got no pair, so no copy of it was read: a slot spent on nothing) are hatched
  and labelled "idle" (:func:`idle_slots`).

A dump is the JSON ``moeserve load --dump`` writes (``format`` ``moeserve.load/1``): it
plots ``window_load`` (or ``total_load`` when the window is empty) and ``placement.phy2log``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moeserve.placement import balancedness, logical_counts

INSTALL_HINT = "pip install 'moeserve[plot]'  (or: pip install matplotlib)"
ANNOTATE_MAX_CELLS = 400  # label cells only while the picture stays readable


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


@dataclass(frozen=True)
class LoadPicture:
    """One column of the picture: ``load`` [L, E]; ``phy2log`` [L, P] and ``num_workers`` when
    the placement is known; ``title`` (e.g. "before the rebalance")."""

    title: str
    load: np.ndarray
    phy2log: np.ndarray | None = None
    num_workers: int = 0
    steps: int = 0

    @classmethod
    def from_dump(cls, path: str | Path, title: str | None = None) -> LoadPicture:
        """Read a ``moeserve load --dump`` file (ValueError saying what is wrong)."""
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a load dump ({e})") from None
        if not isinstance(d, dict) or d.get("format") != "moeserve.load/1":
            raise ValueError(
                f'{path}: not a load dump (expected "format": "moeserve.load/1", as written by moeserve load --dump)'
            )
        steps = int(d.get("window_steps") or 0)
        load = np.asarray(d["window_load"] if steps else d["total_load"], dtype=np.float64)
        if load.ndim != 2:
            raise ValueError(f"{path}: the load must be [MoE layers, experts], got shape {load.shape}")
        p = d.get("placement")
        phy2log = np.asarray(p["phy2log"], dtype=np.int64) if p else None
        if phy2log is not None and (phy2log.ndim != 2 or phy2log.shape[0] != load.shape[0]):
            raise ValueError(f"{path}: placement shape {phy2log.shape} does not match the load's {load.shape}")
        return cls(
            title or d.get("title") or Path(path).stem,
            load,
            phy2log,
            int(p["num_workers"]) if p else 0,
            steps or int(d.get("total_steps") or 0),
        )


def idle_slots(load: np.ndarray, phy2log: np.ndarray) -> np.ndarray:
    """bool [L, P]: the slots that stayed idle over the window, i.e. whose logical expert got
    no (token, k) pair in ``load [L, E]`` (a slot receives pairs of its own expert only, so this
    is exact; a replica of an expert that got pairs may still have been idle in many single
    steps, which window sums cannot tell)."""
    load = np.asarray(load)
    phy2log = np.asarray(phy2log, dtype=np.int64)
    return load[np.arange(load.shape[0])[:, None], phy2log] <= 0


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(f"plotting needs matplotlib, which is not installed: {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_load(pictures: list[LoadPicture], path: str | Path, suptitle: str = "") -> Path:
    """Write the picture of ``pictures`` (1 or more columns) to ``path`` (PNG, SVG, PDF by suffix)."""
    plt = _pyplot()
    if not pictures:
        raise ValueError("nothing to plot")
    layers, experts = pictures[0].load.shape
    with_slots = all(p.phy2log is not None for p in pictures)
    first = pictures[0].phy2log
    slots = first.shape[1] if with_slots and first is not None else 0
    cols = len(pictures)
    width = max(5.0, 0.42 * max(experts, slots) + 2.2)
    row_h = 0.55 * layers + 1.7
    rows = 2 if with_slots else 1
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(width * cols, row_h * rows + (0.6 if suptitle else 0.2)),
        squeeze=False,
        constrained_layout=True,
    )
    vmax = max(float(_share(p.load).max()) for p in pictures) or 1.0
    for c, pic in enumerate(pictures):
        if pic.load.shape != (layers, experts):
            raise ValueError(f"all dumps must have the same shape: {pic.load.shape} vs {(layers, experts)}")
        share = _share(pic.load)  # [L, E]
        ax = axes[0, c]
        im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_title(
            f"{pic.title}\nload per logical expert" + (f" ({pic.steps} steps)" if pic.steps else ""), fontsize=10
        )
        ax.set_xlabel("logical expert")
        ax.set_ylabel("MoE layer")
        _ticks(ax, experts, layers)
        if layers * experts <= ANNOTATE_MAX_CELLS:
            for i in range(layers):
                for j in range(experts):
                    _label(ax, j, i, f"{share[i, j]:.0%}", share[i, j] / vmax)
        if with_slots:
            _slot_panel(axes[1, c], pic, vmax)
    fig.colorbar(im, ax=axes[0, :].tolist(), shrink=0.9, label="share of the layer's pairs")
    if suptitle:
        fig.suptitle(suptitle, fontsize=12)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _share(load: np.ndarray) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    tot = load.sum(axis=1, keepdims=True)
    return np.divide(load, tot, out=np.zeros_like(load), where=tot > 0)


def _slot_panel(ax, pic: LoadPicture, vmax: float) -> None:
    phy2log = pic.phy2log
    assert phy2log is not None  # plot_load draws slot panels only when every picture has a placement
    layers, slots = phy2log.shape
    w = pic.num_workers
    share = _share(pic.load)
    cnt = logical_counts(phy2log, pic.load.shape[1])  # [L, E]
    rows = np.arange(layers)[:, None]
    per_slot = share[rows, phy2log] / cnt[rows, phy2log]  # [L, P] even split
    bal = balancedness(pic.load, phy2log, w)  # [L]
    ax.imshow(per_slot, aspect="auto", cmap="viridis", vmin=0, vmax=vmax, interpolation="nearest")
    idle = idle_slots(pic.load, phy2log)  # [L, P]
    for i, j in zip(*np.nonzero(idle)):
        ax.add_patch(_patch(j, i))
    s = slots // w
    for k in range(1, w):
        ax.axvline(k * s - 0.5, color="white", linewidth=3)
    ax.set_xticks([k * s + (s - 1) / 2 for k in range(w)], [f"worker {k}" for k in range(w)])
    ax.set_yticks(range(layers), [f"{i}  ({b:.2f})" for i, b in enumerate(bal)])
    ax.set_ylabel("MoE layer  (balancedness)")
    n_idle = int(idle.sum())
    ax.set_title(
        f"load per physical slot (an expert's load split evenly over its replicas)\n"
        f"mean balancedness {bal.mean():.3f}"
        + (f"; {n_idle} replica{'s' if n_idle != 1 else ''} idle (hatched: no pair in the window)" if n_idle else ""),
        fontsize=10,
    )
    if layers * slots <= ANNOTATE_MAX_CELLS:
        for i in range(layers):
            for j in range(slots):
                _label(ax, j, i, f"e{phy2log[i, j]}" + ("\nidle" if idle[i, j] else ""), per_slot[i, j] / vmax)


def _patch(x: int, y: int):
    """A hatched box over the cell (x, y): an idle replica."""
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, hatch="xx", edgecolor="red", linewidth=0.8)


def _ticks(ax, n_x: int, n_y: int) -> None:
    step_x = max(1, n_x // 32)
    step_y = max(1, n_y // 24)
    ax.set_xticks(range(0, n_x, step_x))
    ax.set_yticks(range(0, n_y, step_y))


def _label(ax, x: int, y: int, text: str, level: float) -> None:
    ax.text(x, y, text, ha="center", va="center", fontsize=7, color="black" if level > 0.6 else "white")
