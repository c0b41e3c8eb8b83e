"""Load estimation: a ring buffer of the last steps' logical counts, optionally smoothed."""
import numpy as np
import pytest

from moeserve.balancer.load import LoadWindow


def step(value, layers=2, experts=3):
    return np.full((layers, experts), float(value))


def test_the_window_sums_the_last_window_size_steps():
    win = LoadWindow(2, 3, window_size=3)
    for v in (1, 2, 3, 4, 5):
        win.record(step(v))
    assert win.window_sum().tolist() == step(3 + 4 + 5).tolist()
    assert (win.steps, win.filled) == (5, 3)
    assert win.load().tolist() == step(12).tolist()


def test_a_partly_filled_window_sums_what_it_has():
    win = LoadWindow(2, 3, window_size=4)
    win.record(step(7))
    assert win.load().tolist() == step(7).tolist() and win.filled == 1


def test_ema_smooths_across_closed_windows():
    win = LoadWindow(1, 1, window_size=2, ema=0.5)
    win.record(step(1, 1, 1)); win.record(step(1, 1, 1))
    assert win.close_window().tolist() == [[2.0]]                     # the first window starts it
    win.record(step(3, 1, 1)); win.record(step(3, 1, 1))
    assert win.load().tolist() == [[2.0]]                             # unchanged until closed
    assert win.close_window().tolist() == [[0.5 * 6 + 0.5 * 2]]


def test_reset_forgets_everything():
    win = LoadWindow(2, 3, 2, ema=0.3)
    win.record(step(5)); win.close_window(); win.reset()
    assert win.load().tolist() == step(0).tolist() and win.steps == 0


@pytest.mark.parametrize("counts, message", [
    (np.ones((2, 4)), r"counts have shape \(2, 4\), expected \(2, 3\)"),
    (-np.ones((2, 3)), "finite and non-negative"),
    (np.full((2, 3), np.inf), "finite and non-negative"),
])
def test_bad_counts_are_rejected(counts, message):
    with pytest.raises(ValueError, match=message):
        LoadWindow(2, 3, 2).record(counts)


@pytest.mark.parametrize("kwargs, message", [
    (dict(window_size=0), "window_size must be a positive integer"),
    (dict(ema=0.0), r"ema must be in \(0, 1\]"),
    (dict(ema=1.5), r"ema must be in \(0, 1\]"),
])
def test_bad_settings_are_rejected(kwargs, message):
    args = dict(num_layers=2, num_logical=3, window_size=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        LoadWindow(**args)
