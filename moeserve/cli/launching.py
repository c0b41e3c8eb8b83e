"""What ``moeserve up`` and a node of several hosts (``moeserve.cli.multinode``) share while a
cluster starts and runs: the start-up wait with its progress lines, and the console line per
replaced rank."""

from __future__ import annotations

import signal
import sys
import threading
import time


class Replacements:
    """One console line per rank the launcher replaces (which rank, how it exited, its restarts
    within the launcher's window), and one when the world re-formed with it (from the leader's
    status; the leader's log has the details)."""

    def __init__(self, prog: str, cluster):
        self.prog, self.cluster = prog, cluster
        self.seen = len(cluster.replaced)
        self.waiting: dict[int, int] = {}  # replaced rank -> the generation when it was lost
        self._next = 0.0

    def _generation(self) -> tuple[int, tuple[int, ...]] | None:
        try:
            st = self.cluster.status()
        except Exception:  # the leader is busy re-forming; ask again later
            return None
        return st.generation, st.members

    def say(self) -> None:
        from moeserve.cluster.launcher import RESTART_WINDOW_S
        from moeserve.ops.procs import describe_exit

        c = self.cluster
        for rank, code, at in c.replaced[self.seen :]:
            recent = sum(1 for r, _, t in c.replaced if r == rank and at - t < RESTART_WINDOW_S)
            print(
                f"{self.prog}: rank {rank} ({c.config.role(rank).name}) exited with {describe_exit(code)}: "
                f"starting its replacement (restart {recent} of {c.max_restarts} within {RESTART_WINDOW_S:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            now = self._generation()
            self.waiting[rank] = now[0] if now is not None else 0
        self.seen = len(c.replaced)
        if not self.waiting or time.monotonic() < self._next or not c.alive:
            return
        self._next = time.monotonic() + 1.0
        now = self._generation()
        if now is None:
            return
        generation, members = now
        back = sorted(r for r, lost_at in self.waiting.items() if r in members and generation > lost_at)
        if back:
            print(
                f"{self.prog}: rank{'s' if len(back) > 1 else ''} {', '.join(map(str, back))} "
                f"rejoined: the cluster runs as generation {generation} with ranks {', '.join(map(str, members))}",
                file=sys.stderr,
                flush=True,
            )
            for r in back:
                del self.waiting[r]


def start_cluster(cluster, world: int, on_signal, progress: bool, model: str) -> None:
    """``cluster.start()`` from this (main) thread, which must spawn the ranks: the launcher
    asks the kernel to kill a rank when the thread that spawned it ends. SIGINT is blocked in
    this thread meanwhile, so that the ranks inherit the blocked mask (Ctrl-C at a terminal
    reaches the whole foreground process group: this process alone must decide); a helper
    thread, started before the block, receives it, and ``on_signal`` still runs here. With
    ``progress``, the helper shows the time spent loading."""
    done = threading.Event()
    show = Progress(model, world) if progress else None

    def tick():
        while not done.wait(0.1):
            if show is not None:
                show.tick()

    helper = threading.Thread(target=tick, name="startup-signals", daemon=True)
    helper.start()
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    ok = False
    try:
        cluster.start()
        ok = True
    except BaseException:
        cluster.stop(timeout_s=0)
        raise
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        done.set()
        helper.join(1)
        if show is not None:
            show.end(ok)


class Progress:
    """One line while the ranks load the weights: what is loaded and for how long (on a
    terminal it is rewritten in place, elsewhere a line every 10 s)."""

    def __init__(self, model: str, world: int):
        from pathlib import Path

        files = sorted(Path(model).glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        self.what = f"{size / 2**30:.2f} GiB in {len(files)} file{'s' if len(files) != 1 else ''}"
        self.world = world
        self.start = time.monotonic()
        self.tty = sys.stdout.isatty()
        self.last = -1
        print(f"loading {model} ({self.what}) into {world} rank{'s' if world != 1 else ''}", flush=True)

    def tick(self) -> None:
        s = int(time.monotonic() - self.start)
        if self.tty:
            if s != self.last:
                print(f"\r  loading weights and warming up ... {s} s", end="", flush=True)
        elif s // 10 != self.last // 10 and s >= 10:
            print(f"  loading weights and warming up ... {s} s", flush=True)
        self.last = s

    def end(self, ok: bool) -> None:
        took = time.monotonic() - self.start
        if self.tty:
            print("\r", end="")
        if ok:
            print(
                f"  weights loaded, {self.world} rank{'s' if self.world != 1 else ''} ready in {took:.1f} s", flush=True
            )
