"""Load heatmaps (moeserve/ops/plot.py): one dump, two side by side, bad files, matplotlib missing."""

import builtins
import json

import numpy as np
import pytest

from moeserve.ops.plot import LoadPicture, PlotUnavailable, plot_load

pytestmark = pytest.mark.timeout(120)

LOAD = np.array([[47, 20, 622, 83, 590, 21, 76, 45], [150, 12, 558, 25, 12, 627, 87, 33]])  # [L, E]
BEFORE = np.tile(np.arange(10) % 8, (2, 1))  # [L, P]
AFTER = np.array([[0, 1, 7, 3, 4, 5, 6, 2, 0, 1], [0, 1, 2, 3, 6, 5, 4, 7, 0, 1]])


def dump(path, load, phy2log=None, steps=32):
    d = {
        "format": "moeserve.load/1",
        "total_load": (load * 3).tolist(),
        "window_load": load.tolist(),
        "total_steps": 3 * steps,
        "window_steps": steps,
    }
    if phy2log is not None:
        d["placement"] = {"phy2log": phy2log.tolist(), "version": 1, "num_workers": 2}
    path.write_text(json.dumps(d))
    return path


def is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_dump_reads_into_the_window_load_and_its_placement(tmp_path):
    pic = LoadPicture.from_dump(dump(tmp_path / "a.json", LOAD, BEFORE))
    np.testing.assert_array_equal(pic.load, LOAD)
    np.testing.assert_array_equal(pic.phy2log, BEFORE)
    assert pic.num_workers == 2 and pic.steps == 32


def test_an_empty_window_falls_back_to_the_load_since_start(tmp_path):
    pic = LoadPicture.from_dump(dump(tmp_path / "a.json", LOAD, steps=0))
    np.testing.assert_array_equal(pic.load, LOAD * 3)
    assert pic.phy2log is None


@pytest.mark.parametrize(
    "content,match",
    [
        ("not json", "not a load dump"),
        ('{"format": "something else"}', "moeserve.load/1"),
        ('{"format": "moeserve.load/1", "window_steps": 1, "window_load": [1, 2]}', "shape"),
    ],
)
def test_a_file_that_is_not_a_load_dump_is_refused_with_a_reason(tmp_path, content, match):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(ValueError, match=match):
        LoadPicture.from_dump(bad)


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
def test_one_dump_and_two_dumps_side_by_side_make_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    one = plot_load([LoadPicture.from_dump(dump(tmp_path / "a.json", LOAD))], tmp_path / "one.png")
    two = plot_load(
        [LoadPicture("before", LOAD, BEFORE, 2, 32), LoadPicture("after", LOAD, AFTER, 2, 32)],
        tmp_path / "sub" / "two.png",
        "before and after",
    )
    assert is_png(one) and is_png(two)
    from PIL import Image

    w1, _ = Image.open(one).size
    w2, h2 = Image.open(two).size
    assert w2 > 1.5 * w1 and h2 > 0  # two columns


def test_without_matplotlib_the_message_says_how_to_install_it(tmp_path, monkeypatch):
    real = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(PlotUnavailable, match=r"moeserve\[plot\]"):
        plot_load([LoadPicture("x", LOAD)], tmp_path / "x.png")


def test_replicas_that_stayed_idle_are_marked(tmp_path, monkeypatch):
    from moeserve.ops import plot

    load = LOAD.copy()
    load[0, 1] = 0  # expert 1 of layer 0 got no pair: both its copies idle
    load[1, 7] = 0
    idle = plot.idle_slots(load, BEFORE)
    assert idle.shape == BEFORE.shape
    assert sorted(zip(*np.nonzero(idle))) == [(0, 1), (0, 9), (1, 7)]
    assert not plot.idle_slots(LOAD, BEFORE).any()
    pytest.importorskip("matplotlib", reason="the plot extra is not installed")
    marked = []
    real = plot._patch
    monkeypatch.setattr(plot, "_patch", lambda x, y: marked.append((y, x)) or real(x, y))
    assert is_png(plot_load([LoadPicture("window", load, BEFORE, 2, 32)], tmp_path / "idle.png"))
    assert sorted(marked) == [(0, 1), (0, 9), (1, 7)]
