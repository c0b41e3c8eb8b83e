"""Free ports that stay free until their server binds them, and ports in use reported before
anything loads (moeserve.ops.ports, ``moeserve up``)."""

import itertools
import socket

import pytest

from moeserve.cli import main
from moeserve.ops import ports


@pytest.mark.timeout(30)
def test_picked_ports_lie_outside_the_ephemeral_range_and_are_free():
    # What failed CI at stop 19: a serving port from bind(0), in the ephemeral range, went to a
    # rank's outgoing connection before the front end bound it ("Address already in use").
    low, high = ports.ephemeral_range()
    picked = ports.free_ports(50)
    assert len(set(picked)) == 50
    for p in picked:
        assert not low <= p <= high, (p, low, high)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.timeout(30)
def test_a_port_that_is_held_or_excluded_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports.free_port()))
        held.listen(1)
        busy = held.getsockname()[1]
        spare = ports.free_port(exclude=[busy])
        # Only two candidates: the held one, and one excluded; then the kernel's pick.
        seq = iter([busy, spare] * 200)
        monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, lo, hi: next(seq))
        got = ports.free_port(exclude=[spare])
        assert got not in (busy, spare)
        with socket.socket() as s:
            s.bind(("127.0.0.1", got))


@pytest.mark.timeout(30)
def test_check_bindable_names_the_flag_of_the_port_in_use():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        busy = held.getsockname()[1]
        ports.check_bindable("127.0.0.1", {"--port": ports.free_port(), "--admin-port": 0})
        with pytest.raises(OSError) as e:
            ports.check_bindable("127.0.0.1", {"--port": ports.free_port(), "--balancer-port": busy})
        assert (
            e.value.strerror == f"port {busy} on 127.0.0.1 (--balancer-port) is already in use: stop what "
            f"listens there or choose another port"
        )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", ["--port", "--admin-port", "--balancer-port", "--http-port"])
def test_up_reports_a_port_in_use_before_loading_anything(tmp_path, flag, capsys, monkeypatch):
    from moeserve.cluster import launcher
    from moeserve.models import init_model

    model = str(init_model(tmp_path / "m", "llama4", seed=1))

    def start(self):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(launcher.LocalCluster, "start", start)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        busy = held.getsockname()[1]
        assert (
            main(
                [
                    "up",
                    "--model",
                    model,
                    "--host",
                    "127.0.0.1",
                    flag,
                    str(busy),
                    *[x for f in ("--port", "--admin-port", "--balancer-port") if f != flag for x in (f, "0")],
                ]
            )
            == 1
        )
    err = capsys.readouterr().err
    assert f"moeserve up: error: port {busy} on 127.0.0.1 ({flag}) is already in use" in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_port_another_process_picked_is_not_picked_until_that_process_ends(monkeypatch):
    # What failed CI at stop 52: a test picked the gRPC port of a ``moeserve serve``; while
    # that process loaded, a pick elsewhere took the same port and bound it first.
    import subprocess
    import sys

    def offer(*first):
        """The picker's candidates: ``first``, then what it would draw anyway."""
        rest = iter(lambda: real(lo_hi[0], lo_hi[1]), None)
        seq = itertools.chain(first, rest)
        monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, lo, hi: next(seq))

    rng = ports.random.SystemRandom()
    real = rng.randint
    lo_hi = (ports.ephemeral_range()[1] + 1, 65535)
    code = "from moeserve.ops import ports; import sys; print(ports.free_port(), flush=True); sys.stdin.read()"
    other = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        taken = int(other.stdout.readline())
        with socket.socket() as s:  # nothing binds it: only the reservation stands in the way
            s.bind(("127.0.0.1", taken))
        offer(taken, taken, taken)
        got = ports.free_port()
        assert got != taken
        # This process's own pick is reserved too: the same port is not handed out twice.
        offer(got, got, taken)
        again = ports.free_port()
        assert again not in (got, taken)
    finally:
        other.stdin.close()
        other.wait(10)
    offer(taken)
    assert ports.free_port() == taken  # released when the process that held it ended


@pytest.mark.timeout(30)
def test_a_block_of_ports_is_free_outside_the_ephemeral_range_and_none_is_picked_again(monkeypatch):
    low, high = ports.ephemeral_range()
    base = ports.free_block(5)
    block = list(range(base, base + 5))
    assert not any(low <= p <= high for p in block)
    for p in block:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    # Every port of the block is reserved: offered each of them first, the picker passes them by.
    real = ports.random.SystemRandom().randint
    seq = itertools.chain(block * 3, iter(lambda: real(high + 1, 65535), None))
    monkeypatch.setattr(ports.random.SystemRandom, "randint", lambda self, lo, hi: next(seq))
    assert ports.free_port() not in block
