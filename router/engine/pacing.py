"""When the leader schedules the next step: as late as the devices allow (late scheduling).

With asynchronous steps the host runs one step ahead: the leader schedules step N+1 as soon
as step N is enqueued and step N-1's tokens are back, that is when the GPUs *start* step N.
A request that arrives while they run it joins step N+2, and its first token comes two steps
after it was scheduled. The pacer moves the schedule of step N+1 to just before the GPUs are
expected to finish step N: a request that arrives in between joins N+1, one step earlier,
and the GPUs do not wait if the estimates hold (docs/dataplane.md, "Late scheduling").

What it reads, per step k (times from ``time.perf_counter`` on the leader's rank):

- ``tokens_at``: when the leader's rank had step k-1's tokens (``deliver`` returned), and
  ``tokens_wait_s``, how long it waited for them. A wait (over ``busy_s``) says the GPU was
  still running step k-1 when the host got there, and that step k was already enqueued: the
  GPU ran step k from ``tokens_at`` on, without a gap.
- ``lead_s``: the host's time from the start of step k's schedule to the end of its enqueue on
  the slowest rank (scheduling, the header's broadcast, the rank's own enqueue).

Two waited steps in a row give a step's device time, ``tokens_at[k+1] - tokens_at[k]`` (no
gap hides in it). The next schedule starts at ``tokens_at + T - H - margin - c``: T the shortest
device time among the last ``window`` steps, H the longest lead among them. A step that did not
wait (the GPU was idle when the host came: a bubble, an estimate too late, or the host is the
bottleneck) schedules the next at once, so that a wrong estimate costs at most one gap.

``c`` is the pacer's own correction, learnt from the steps it delayed. After a delayed
schedule, the wait for the running step's tokens is the slack the GPU was left with: it should
be ``margin``. Where it is shorter, ``c`` grows by a quarter of the shortfall, where it is
longer it shrinks the same way (never below 0); where there was no wait at all (a *bubble*: the
GPU went idle before the step was enqueued, from a late wake-up, a busy interpreter lock or a
lead the window did not see) it grows by ``margin`` + 0.25 ms at once. So a delay that keeps
costing bubbles backs off within a few steps, whatever the cause (``bubbles`` counts them).

The longest lead of the window is an upper bound: a mixed step's schedule and enqueue take
longer than a decode step's, and one of them in the window sets H for 16 steps, while ``c``
never goes below 0, so a slack above the margin is never taken back. With ``learn_lead``
(``MOESERVE_PACER_LEARN_LEAD=1``, a measurement switch until a GPU has shown it) the correction
may go down to -H: the slack the GPU is left decides how far ahead the schedule starts, never
less than the margin, and a bubble still pushes it back at once.
"""

from __future__ import annotations

from collections import deque

from moeserve.config import env_switch

GAIN = 0.25  # of the slack's error, added to the correction after each delayed schedule
BUBBLE_STEP_S = 2.5e-4  # the correction's growth after a bubble, beyond the margin


class StepPacer:
    """The delay before each schedule (seconds), from the steps' timings (``on_step``).

    margin_s: how long before the estimated end of the running step the next one should be
    enqueued; window: steps the estimates look back over; busy_s: the shortest wait for tokens
    that says the GPU was busy; max_delay_s: the longest delay, whatever the estimates say."""

    def __init__(
        self,
        margin_s: float,
        window: int = 16,
        busy_s: float = 2e-4,
        max_delay_s: float = 0.05,
        learn_lead: bool = False,
    ):
        if margin_s < 0:
            raise ValueError(f"margin_s must be >= 0, got {margin_s}")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.margin_s, self.busy_s, self.max_delay_s = margin_s, busy_s, max_delay_s
        self.learn_lead = learn_lead
        self._device: deque[float] = deque(maxlen=window)  # device times of whole steps
        self._lead: deque[float] = deque(maxlen=window)  # hosts' schedule-to-enqueued times
        self._tokens_at: float | None = None  # when the latest step's tokens came
        self._busy = False  # whether the GPU was busy then (and runs the latest step since)
        self.delays = 0  # schedules delayed, and their total (for the metrics and tests)
        self.delayed_s = 0.0
        self.bubbles = 0  # delayed schedules after which the GPU went idle before the step came
        # per delayed schedule, in total: how long before the running step's estimated end it
        # was (lead + margin + correction: what a request it takes waits beyond its own step),
        # and the slack the GPU was then left with (the next step's wait for tokens)
        self.ahead_s = 0.0
        self.slack_s = 0.0
        self.correction_s = 0.0  # c: learnt from the slack the delayed schedules left
        self._delayed = False  # the latest schedule was delayed (its step's slack is pending)

    def on_step(self, forward: bool, lead_s: float, tokens_at: float, tokens_wait_s: float) -> None:
        """Step k's timings: whether it runs a forward pass, the host's lead, when step k-1's
        tokens came and how long the leader's rank waited for them."""
        busy = forward and tokens_wait_s > self.busy_s
        if self._delayed and forward:  # the slack the delayed schedule left the GPU
            self._delayed = False
            if busy:
                self.slack_s += tokens_wait_s
                floor = -max(self._lead) if self.learn_lead and self._lead else 0.0
                self.correction_s = max(floor, self.correction_s + GAIN * (self.margin_s - tokens_wait_s))
            else:
                self.bubbles += 1
                self.correction_s += self.margin_s + BUBBLE_STEP_S
            self.correction_s = min(self.correction_s, self.max_delay_s)
        if busy and self._busy and self._tokens_at is not None:
            self._device.append(tokens_at - self._tokens_at)
        if forward:
            self._lead.append(lead_s)
        self._busy, self._tokens_at = busy, tokens_at

    def reset(self) -> None:
        """Forget the estimates (the world re-formed: other ranks, other times)."""
        self._device.clear()
        self._lead.clear()
        self._busy, self._tokens_at = False, None
        self._delayed, self.correction_s = False, 0.0

    def delay(self, now: float) -> float:
        """Seconds to wait at ``now`` before scheduling the next step (0: at once)."""
        if not self._busy or self._tokens_at is None or len(self._device) < 2 or not self._lead:
            return 0.0
        start = self._tokens_at + min(self._device) - self.ahead()
        return min(max(0.0, start - now), self.max_delay_s)

    def ahead(self) -> float:
        """How long before the running step's estimated end the next schedule starts: the
        longest lead of the window, the margin and the correction."""
        lead = max(self._lead) if self._lead else 0.0
        return max(lead + self.correction_s, 0.0) + self.margin_s

    def note_delay(self, seconds: float) -> None:
        """The leader waits ``seconds`` before this schedule (the next forward step's wait for
        tokens tells how much slack it left)."""
        self.delays += 1
        self.delayed_s += seconds
        self.ahead_s += self.ahead()
        self._delayed = True


def learn_lead_setting() -> bool:
    """``MOESERVE_PACER_LEARN_LEAD``: 0 (the default: the correction never below 0) or 1 (it
    may take back the window's longest lead where the slack says so); anything else is refused
    by name."""
    return env_switch("MOESERVE_PACER_LEARN_LEAD", "0", "the slack sets the look-ahead", "never below the longest lead")
