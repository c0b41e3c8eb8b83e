"""The cluster's rendezvous store and the membership agreed through it, in this process: only a
holder of the cluster's secret reads or writes a key (a stranger's TCPStore client, a wrong
secret and garbage are closed before they touch one; a store without the secret is not
believed); the store serves torch.distributed's rendezvous; the leader decides each
generation from the members that reported a failed step, the replacements that joined and the
launcher's marks; a member left out of a generation learns it."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from moeserve.cluster.recovery import Dropped, Generation, Membership
from moeserve.cluster.store import AuthStore, StoreError, StoreTimeout, serve
from moeserve.config import ClusterConfig

SECRET = b"s" * 16
T = datetime.timedelta(seconds=5)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    srv = serve("127.0.0.1", 0, SECRET)
    yield srv
    srv.close()


def test_the_store_answers_the_requests_torch_distributed_makes(server):
    host, port = server.address
    a, b = AuthStore(host, port, SECRET, T), AuthStore(host, port, SECRET, T)
    a.set("k", b"v\x00\xff")
    assert b.get("k") == b"v\x00\xff" and b.check(["k"]) and not b.check(["k", "nope"])
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert a.compare_set("c", "", "first") == b"first"  # absent and expected empty: set
    assert a.compare_set("c", "other", "second") == b"first"  # not as expected: unchanged
    assert a.compare_set("c", "first", "second") == b"second"
    assert a.num_keys() == 3 and a.delete_key("n") and not a.delete_key("n")
    got = {}
    waiter = threading.Thread(target=lambda: got.update(v=b.get("later")))  # blocks until set
    waiter.start()
    time.sleep(0.1)
    a.set("later", "x")
    waiter.join(5)
    assert got["v"] == b"x"
    with pytest.raises(StoreTimeout):
        b.wait(["never"], datetime.timedelta(seconds=0.2))
    assert b.get_now("never") is None and b.get_now("k") == b"v\x00\xff"


def test_gloo_meets_through_the_store(server):
    host, port = server.address
    store = AuthStore(host, port, SECRET, T)
    out = [None, None]

    def rank(r):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("generation0", store), r, 2, datetime.timedelta(seconds=20))
        t = torch.tensor([r + 1.0])
        pg.allreduce([t]).wait()
        out[r] = float(t)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == [3.0, 3.0]


def test_a_stranger_reads_and_writes_nothing(server):
    host, port = server.address
    owner = AuthStore(host, port, SECRET, T)
    owner.set("gen", "mine")
    with pytest.raises(dist.DistNetworkError):  # torch's own client: the store does not speak its protocol
        stranger = dist.TCPStore(host, port, 2, False, datetime.timedelta(seconds=3))
        stranger.add("generation", 1)
    with pytest.raises(StoreError, match="refused this rank's secret"):
        AuthStore(host, port, b"w" * 16, T)
    for junk in (b"", b"\x00" * 64, b"\xff" * 4096, b"GET / HTTP/1.1\r\n\r\n"):
        with socket.create_connection((host, port), timeout=30) as s:
            try:
                s.sendall(junk)
                s.shutdown(socket.SHUT_WR)
                while s.recv(4096):  # the server closes it
                    pass
            except OSError:  # closed (reset) with the junk unread
                pass
    assert owner.get("gen") == b"mine" and not owner.check(["generation"])
    assert owner.num_keys() == 1
    assert server.refused >= 5


def test_a_store_that_does_not_hold_the_secret_is_not_believed():
    impostor = serve("127.0.0.1", 0, b"i" * 16)
    try:
        with pytest.raises(StoreError):
            AuthStore(*impostor.address, SECRET, T)
    finally:
        impostor.close()
    with socket.create_server(("127.0.0.1", 0)) as other:  # not a store at all
        port = other.getsockname()[1]
        threading.Thread(target=lambda: other.accept()[0].sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 64)).start()
        with pytest.raises(StoreError, match="not a moeserve store"):
            AuthStore("127.0.0.1", port, SECRET, T)


def test_a_silent_connection_holds_nothing_up(server):
    host, port = server.address
    silent = [socket.create_connection((host, port)) for _ in range(10)]  # never answer the challenge
    try:
        store = AuthStore(host, port, SECRET, T)
        store.set("a", "1")
        assert store.get("a") == b"1"
    finally:
        for s in silent:
            s.close()


# -- the membership -----------------------------------------------------------------------------


def _cfg(routers=2, workers=2, settle=0.3):
    return ClusterConfig(model_dir="unused", routers=routers, workers=workers, recovery_settle_s=settle)


def _members(server, cfg):
    host, port = server.address
    return {r: Membership(cfg, r, AuthStore(host, port, SECRET, T)) for r in range(cfg.world_size)}


def test_the_leader_re_forms_without_a_router_that_never_reports(server):
    cfg = _cfg()
    m = _members(server, cfg)
    m[0].publish(m[0].gen)
    for r in (2, 3):  # the workers report; router 1 is gone
        m[r].store.set(f"failed/0/{r}", "1")
    t0 = time.monotonic()
    gen, survivors = m[0].decide(cfg.recovery_settle_s, 10.0)
    assert gen == Generation(1, (0, 2, 3)) and survivors == {0, 2, 3}
    assert time.monotonic() - t0 >= cfg.recovery_settle_s  # it waited for the router to report
    assert m[2].await_next(5) == gen
    m[1].gen = Generation(0, (0, 1, 2, 3))
    with pytest.raises(Dropped, match="not in generation 1"):
        m[1].await_next(5)


def test_a_router_the_launcher_marked_lost_is_not_waited_for(server):
    cfg = _cfg(settle=30.0)
    m = _members(server, cfg)
    for r in (2, 3):
        m[r].store.set(f"failed/0/{r}", "1")
    m[0].store.set("lost/1", "1")
    t0 = time.monotonic()
    gen, _ = m[0].decide(cfg.recovery_settle_s, 60.0)
    assert gen.members == (0, 2, 3) and time.monotonic() - t0 < 10
    assert not m[0].store.check(["lost/1"])  # a mark serves once


def test_a_lost_worker_is_waited_for_and_its_replacement_admitted(server):
    cfg = _cfg()
    m = _members(server, cfg)
    m[0].publish(m[0].gen)
    m[0].store.set("running", "1")
    for r in (1, 2):
        m[r].store.set(f"failed/0/{r}", "1")
    replacement = Membership(cfg, 3, m[3].store)
    assert replacement.replacing()
    box = {}
    joiner = threading.Thread(target=lambda: box.update(gen=replacement.join_running(20)))
    decided = {}
    leader = threading.Thread(target=lambda: decided.update(out=m[0].decide(cfg.recovery_settle_s, 20.0)))
    leader.start()
    time.sleep(1.0)  # the leader waits for worker 3: it has no replacement yet
    assert leader.is_alive()
    joiner.start()
    leader.join(20)
    joiner.join(20)
    gen, survivors = decided["out"]
    assert gen == box["gen"] == Generation(1, (0, 1, 2, 3)) and survivors == {0, 1, 2}


def test_a_lost_worker_without_a_replacement_is_fatal(server):
    cfg = _cfg()
    m = _members(server, cfg)
    for r in (1, 2):
        m[r].store.set(f"failed/0/{r}", "1")
    assert m[0].decide(cfg.recovery_settle_s, 1.0) is None


def test_a_rank_that_joins_a_running_world_is_admitted_between_steps(server):
    cfg = _cfg()
    m = _members(server, cfg)
    m[0].gen = Generation(1, (0, 2, 3))  # router 1 was left out
    m[0].publish(m[0].gen)
    m[0].store.set("running", "1")
    assert not m[0].poll_joins()
    late = Membership(cfg, 1, m[1].store)
    box = {}
    joiner = threading.Thread(target=lambda: box.update(gen=late.join_running(20)))
    joiner.start()
    deadline = time.monotonic() + 10
    while not m[0].poll_joins():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    gen = m[0].with_joins()
    joiner.join(20)
    assert gen == box["gen"] == Generation(2, (0, 1, 2, 3))
    assert gen.members.index(2) == 2  # a member's world rank is its index among the members
