"""Input and answers that must not hurt the cluster, against one live ``moeserve up``
cluster (1 router + 2 workers, gloo, EPLB with redundant slots, the HTTP API, metrics on every
process): tiny temperatures are greedy and kill nothing; connect+close, garbage and idle
connections on every port the cluster listens on leave generation working; health and
``moeserve_ready`` say NOT_SERVING while the step loop is stalled or the leader cannot answer;
the front end's limits hold before any conversion; a tokenizer held busy does not stop another
stream; malformed protobuf and bad placement files are INVALID_ARGUMENT; bad balancer settings
are refused and stop nothing. (State across restarts: test_state_dir.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from cluster_util import prompts_for, reference_generate, reference_model, tiny_checkpoint
from control_util import TOKEN, Up, children_of, cmdline
from grpc_health.v1 import health_pb2, health_pb2_grpc
from ops_util import samples, scrape

from moeserve.client import BalancerSettings, Client, MoeserveError

WORKERS, REDUNDANT = 2, 2
QUIET = "1000000000"  # a step interval the balancer's loop never reaches

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


# -- the cluster --------------------------------------------------------------------------------


def _ranks(up: Up) -> dict[int, int]:
    """rank -> pid of the rank processes ``moeserve up`` started."""
    out = {}
    for pid in children_of(up.proc.pid):
        if "moeserve.cluster.rank" in cmdline(pid):
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK="))
            out[rank] = pid
    return out


def _environ(pid: int) -> dict[str, str]:
    pairs = (e.split(b"=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in e)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = str(tiny_checkpoint(tmp_path_factory.mktemp("rel"), "llama4"))
    model = reference_model(path)
    prompt = prompts_for(model.config.vocab_size, lengths=(7,), seed=5)[0]
    want = reference_generate(model, prompt, 8)
    up = Up(
        path,
        "--workers",
        str(WORKERS),
        "--enable-eplb",
        "--num-redundant-experts",
        str(REDUNDANT),
        "--http-port",
        "0",
        "--metrics-port",
        "0",
        "--eplb-step-interval",
        QUIET,
        "--balancer-poll-interval",
        "0.2",
        "--grace-period",
        "2",
    )
    out = up.output()
    http = int(re.search(r"^http\s+http://[\d.]+:(\d+)/v1", out, re.M).group(1))
    metrics = {
        m.group(1).strip(): int(m.group(2))
        for m in re.finditer(r"^metrics\s+(.+?)\s+http://[\d.]+:(\d+)/metrics", out, re.M)
    }
    log0 = (Path(up.log_dir) / "rank0.log").read_text()
    chost, cport = re.search(r"local channel on ([\d.]+):(\d+)", log0).groups()
    serving, admin, balancer = up.clients(timeout=30)
    yield dict(
        up=up,
        path=path,
        model=model,
        prompt=prompt,
        want=want,
        http=http,
        metrics=metrics,
        channel=(chost, int(cport)),
        serving=serving,
        admin=admin,
        balancer=balancer,
        info=admin.status().model,
    )
    up.stop()


def serves(c) -> None:
    """The cluster answers a known prompt with the single-process reference tokens."""
    out = c["serving"].generate(prompt_token_ids=c["prompt"], max_tokens=8, ignore_eos=True, timeout=60)
    assert out.token_ids == c["want"], c["up"].logs()


def _health(address: str, timeout: float = 3.0):
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
        except grpc.RpcError as e:
            return e.code()


def _http_health(port: int) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return -1


def _http_complete(port: int, prompt, n: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    return choice


# -- 1. every accepted input is safe ------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1e-320, 5e-324, 1e-6, 9.99e-6])
def test_a_tiny_temperature_is_greedy_and_the_cluster_still_serves(cluster, temperature):
    c = cluster
    out = c["serving"].generate(prompt_token_ids=[1, 2, 3], max_tokens=4, temperature=temperature)
    assert len(out.token_ids) >= 1 and out.finish_reason in ("length", "stop")
    greedy = c["serving"].generate(prompt_token_ids=c["prompt"], max_tokens=8, temperature=temperature, ignore_eos=True)
    assert greedy.token_ids == c["want"]
    streamed = [
        t
        for ch in c["serving"].generate_stream(
            prompt_token_ids=c["prompt"], max_tokens=8, temperature=temperature, ignore_eos=True
        )
        for t in ch.token_ids
    ]
    assert streamed == c["want"]
    serves(c)
    assert c["admin"].status().error == ""


def test_limits_hold_at_the_front_end_before_any_conversion(cluster):
    c = cluster
    s = c["serving"]
    fe = c["up"].child("frontend")

    def peak_rss_kib() -> int:
        for line in Path(f"/proc/{fe}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return 0

    before = peak_rss_kib()
    with pytest.raises(MoeserveError) as e:  # 50 MB of ids: gRPC refuses it unparsed
        s.generate(prompt_token_ids=[100_000] * 12_500_000, max_tokens=1)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.message
    with pytest.raises(MoeserveError) as e:  # a million stop ids, counted before conversion
        s.generate(prompt_token_ids=[1, 2], max_tokens=1, stop_token_ids=[7] * 1_000_000)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in e.value.message
    with pytest.raises(MoeserveError) as e:  # larger ids do not fit in a valid request
        s.generate(prompt_token_ids=[1, 2], max_tokens=1, stop_token_ids=[100_000] * 1_000_000)
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert peak_rss_kib() - before < 64 << 10, "the front end grew by more than 64 MiB for requests it refused"
    # HTTP: a 50 MB body is refused on its Content-Length, before a byte of it is read or parsed.
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", c["http"], timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(50_000_000))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "at most" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()
    assert peak_rss_kib() - before < 64 << 10, "the front end grew by more than 64 MiB for requests it refused"
    for kw, what in (
        (dict(prompt_token_ids=[5] * 5000), "max_model_len is 4096"),
        (dict(prompt_token_ids=[1, 2], stop_token_ids=[7] * 300), "at most 256"),
        (dict(prompt="a" * (4096 * 64 + 1)), "more than this server tokenizes"),
    ):
        with pytest.raises(MoeserveError) as e:
            s.generate(max_tokens=1, **kw)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message, e.value.message
    serves(c)


def _http(port: int, path: str, body: bytes, timeout: float = 120) -> tuple[int, dict]:
    """(status, parsed error or answer) of a POST of raw JSON bytes."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
    finally:
        conn.close()
    try:
        return r.status, json.loads(raw)
    except ValueError:
        return r.status, {"raw": raw[:200].decode(errors="replace")}


def test_a_request_of_death_is_refused_and_the_cluster_serves_on(cluster):
    """top_k >= 2**63 once made the leader overflow encoding the step header: every rank died."""
    c = cluster
    vocab = c["model"].config.vocab_size
    for top_k in (2**63, 2**64 + 5, vocab + 1):
        body = json.dumps({"prompt": [5, 6], "max_tokens": 2, "temperature": 1.0, "top_k": top_k}).encode()
        st, out = _http(c["http"], "/v1/completions", body)
        assert st == 400 and "top_k must be in" in out["error"]["message"], (top_k, st, out)
        assert out["error"]["param"] == "top_k"
    for top_k in (2**62, vocab + 1):  # gRPC carries an int64: as large as the header holds
        with pytest.raises(MoeserveError) as e:
            c["serving"].generate(prompt_token_ids=[5, 6], max_tokens=2, temperature=1.0, top_k=top_k)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_k must be in" in e.value.message
    # -1 is "no top-k" on gRPC too, as the bound's message, the HTTP API and vLLM say
    same = [
        c["serving"].generate(prompt_token_ids=[5, 6], max_tokens=4, temperature=1.0, seed=7, top_k=k).token_ids
        for k in (0, -1)
    ]
    assert same[0] == same[1] and len(same[0]) == 4
    serves(c)
    assert c["admin"].status().error == ""
    assert c["up"].proc.poll() is None


def test_client_errors_are_client_errors_not_server_errors(cluster):
    """A prompt id of 10**30 was 503 "cluster unavailable" (clients retry it), a lone surrogate 500."""
    c = cluster
    cases = [
        (
            b'{"prompt": [5, 1000000000000000000000000000000], "max_tokens": 2}',
            "is outside the vocabulary [0, ",
            "prompt",
        ),
        (
            b'{"prompt": [5], "stop_token_ids": [1000000000000000000000000000000]}',
            "is outside the vocabulary [0, ",
            "stop_token_ids",
        ),
        (b'{"prompt": "abc \\ud800 def", "max_tokens": 2}', "not valid Unicode", None),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', "not valid Unicode", None),
    ]
    for body, fragment, param in cases:
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        st, out = _http(c["http"], path, body)
        assert st == 400 and fragment in out["error"]["message"], (body, st, out)
        assert out["error"]["param"] == param, out
    serves(c)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def test_oversized_requests_are_refused_before_rendering_and_the_front_end_gives_its_memory_back(cluster):
    """A 5.5 MB chat_template_kwargs value was rendered and tokenized in full before refusal;
    150k empty messages too; the front end's RSS climbed to 3.9 GB over 24 refusals and stayed."""
    c = cluster
    fe = c["up"].child("frontend")
    hi = [{"role": "user", "content": "hi"}]
    ok = json.dumps({"messages": hi, "max_tokens": 2, "temperature": 0}).encode()
    assert _http(c["http"], "/v1/chat/completions", ok)[0] == 200
    base = _rss_kib(fe)
    heavy = [
        json.dumps({"messages": hi, "max_tokens": 2, "chat_template_kwargs": {"bos_token": "x" * 5_500_000}}).encode(),
        json.dumps({"messages": [{"role": "user", "content": ""}] * 150_000, "max_tokens": 2}).encode(),
        json.dumps({"prompt": "lorem ipsum " * 400_000, "max_tokens": 2}).encode(),  # 4.8 MB of text
    ]
    for i in range(100):
        body = heavy[i % len(heavy)]
        path = "/v1/completions" if body.startswith(b'{"prompt"') else "/v1/chat/completions"
        st, out = _http(c["http"], path, body)
        assert st == 400 and "larger than this server takes" in out["error"]["message"], (i, st, out)
    grown = (_rss_kib(fe) - base) / 1024
    assert grown < 50, f"the front end kept {grown:.0f} MB more after 100 refused requests"
    assert _http(c["http"], "/v1/chat/completions", ok)[0] == 200
    serves(c)


def test_a_64_mb_header_line_is_431_and_costs_the_front_end_nothing(cluster):
    c = cluster
    fe = c["up"].child("frontend")
    base = _rss_kib(fe)
    with socket.create_connection(("127.0.0.1", c["http"]), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: ")
        sent, answer = 0, b""
        try:
            while sent < 64 << 20:
                sock.sendall(b"a" * (1 << 20))
                sent += 1 << 20
            sock.sendall(b"\r\n\r\n")
        except OSError:  # the server answered and closed
            pass
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
    grown = (_rss_kib(fe) - base) / 1024
    assert grown < 16, f"the front end grew by {grown:.0f} MB reading a header it refused"
    assert _http_health(c["http"]) == 200


def test_a_tokenizer_held_busy_on_a_huge_prompt_does_not_stop_another_stream(cluster):
    """A front end in this process on the live leader's channel, with a tokenizer that blocks
    until the test releases it: a stream of ids completes meanwhile (no timing assertion)."""
    from moeserve.router.engine.channel import AsyncEngineClient
    from moeserve.rpc import serving_pb2_grpc
    from moeserve.services.admission import Admission
    from moeserve.services.frontend import ServingService
    from moeserve.services.server import SERVING, ServerOptions, ServiceServer, ThreadedServer
    from moeserve.services.tokenizer import ModelTokenizer

    c = cluster
    key = bytes.fromhex(_environ(c["up"].child("frontend"))["MOESERVE_CONTROL_KEY"])
    entered, release = threading.Event(), threading.Event()

    class HeldTokenizer(ModelTokenizer):
        def __init__(self):
            super().__init__(None)

        def encode(self, text, add_special_tokens=True):
            entered.set()
            assert release.wait(120), "never released"
            return list(c["prompt"])

        def decode(self, ids, skip_special_tokens=True):
            return ""

    service = ServingService(admission=Admission(AsyncEngineClient(c["channel"], key), HeldTokenizer()))
    srv = ThreadedServer(
        ServiceServer(SERVING, lambda s: serving_pb2_grpc.add_ServingServicer_to_server(service, s), ServerOptions())
    )
    srv.start()
    try:
        client = Client(f"127.0.0.1:{srv.server.port}", timeout=60)
        held: dict = {}

        def huge():
            try:
                held["out"] = client.generate("x" * 200_000, max_tokens=8, ignore_eos=True)
            except Exception as e:  # reported below
                held["error"] = e

        t = threading.Thread(target=huge, daemon=True)
        t.start()
        assert entered.wait(60), "the huge prompt never reached the tokenizer"
        chunks = list(client.generate_stream(prompt_token_ids=c["prompt"], max_tokens=8, ignore_eos=True))
        assert [tok for ch in chunks for tok in ch.token_ids] == c["want"]
        assert t.is_alive() and not release.is_set()  # the tokenizer was still busy throughout
        release.set()
        t.join(60)
        assert "error" not in held, held.get("error")
        assert held["out"].token_ids == c["want"]
    finally:
        release.set()
        srv.stop(grace_s=1)


# -- 2. no silent wedge -------------------------------------------------------------------------


def _store_port(up) -> int:
    """The torch.distributed store's port: MASTER_PORT in the leader rank's environment."""
    from control_util import children_of

    for pid in _descendants(up.proc.pid, children_of):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if env.get(b"RANK") == b"0" and b"MASTER_PORT" in env:
            return int(env[b"MASTER_PORT"])
    raise AssertionError("no leader rank found")


def _descendants(pid: int, children_of) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def _every_port(c) -> dict[str, int]:
    up = c["up"]
    ports = {
        "serving gRPC": up.port,
        "HTTP": c["http"],
        "admin gRPC": up.admin_port,
        "balancer gRPC": up.balancer_port,
        "leader's local channel": c["channel"][1],
        "torch.distributed store": _store_port(up),
    }
    ports.update({f"metrics of {name}": port for name, port in c["metrics"].items()})
    return ports


GARBAGE = [
    b"\x00" * 64,
    b"\xff" * 4096,
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(512),
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(300),  # a TLS ClientHello's start
    b"\x00\x00\x00\x00\x00\x00\xff\xff" + os.urandom(64),  # a huge frame length
    b"MSCH" + os.urandom(100),
]


def test_connect_close_garbage_and_idle_connections_on_every_port_leave_generation_working(cluster):
    c = cluster
    ports = _every_port(c)
    assert len(c["metrics"]) == 1 + WORKERS + 2  # every rank, the front end, the balancer
    idle = []
    try:
        for name, port in ports.items():
            socket.create_connection(("127.0.0.1", port), timeout=5).close()  # connect + close
            for junk in GARBAGE:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    try:
                        s.sendall(junk)
                        s.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass  # the server hung up first
            for _ in range(3):  # connections that say nothing
                idle.append((name, socket.create_connection(("127.0.0.1", port), timeout=5)))
            half = socket.create_connection(("127.0.0.1", port), timeout=5)  # a frame header, then silence
            half.sendall(b"\x00\x00\x00\x00\x00\x00\x10")
            idle.append((name, half))
        # With every idle connection still open: every service answers, generation works.
        serves(c)
        choice = _http_complete(c["http"], c["prompt"], 8)
        assert choice["finish_reason"] == "length"
        assert c["admin"].placement().phy2log.shape[1] == c["info"].num_slots
        assert c["balancer"].balancer_status().admin_reachable
        for name, port in ports.items():
            if name.startswith("metrics"):
                assert "moeserve_process_info" in scrape(port), name
        for addr in (c["up"].serving, c["up"].admin, c["up"].balancer):
            assert _health(addr) == health_pb2.HealthCheckResponse.SERVING, addr
        assert _http_health(c["http"]) == 200
        # The leader's channel closes a connection that never completed its handshake.
        chan = [s for name, s in idle if name == "leader's local channel"]
        for s in chan:
            s.settimeout(30)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
    finally:
        for _, s in idle:
            s.close()
    serves(c)


def _wait_for(what, cond, timeout_s: float = 40.0, every_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(every_s)


def _readiness(c, name: str) -> tuple[float, str | None]:
    text = scrape(c["metrics"][name])
    ready = samples(text, "moeserve_ready")[()]
    reasons = [dict(k)["reason"] for k, v in samples(text, "moeserve_not_ready_reason").items() if v == 1.0]
    return ready, (reasons[0] if reasons else None)


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


def test_health_is_not_serving_while_the_step_loop_is_stalled_and_a_metric_says_why(cluster):
    c = cluster
    up = c["up"]
    worker = _ranks(up)[WORKERS]  # the last expert worker
    for name in ("rank 0 (router, leader)", "front end", "balancer"):
        assert _readiness(c, name) == (1.0, None), name
    os.kill(worker, signal.SIGSTOP)  # every step waits for it
    try:
        _wait_for("the front end's health NOT_SERVING", lambda: _health(up.serving) == NOT_SERVING)
        _wait_for("the admin's health NOT_SERVING", lambda: _health(up.admin) == NOT_SERVING)
        _wait_for("the balancer's health NOT_SERVING", lambda: _health(up.balancer) == NOT_SERVING)
        assert _http_health(c["http"]) == 503
        for name in ("rank 0 (router, leader)", "front end", "balancer"):
            assert _readiness(c, name) == (0.0, "step_stalled"), name
    finally:
        os.kill(worker, signal.SIGCONT)
    for addr in (up.serving, up.admin, up.balancer):
        _wait_for(f"{addr} SERVING again", lambda: _health(addr) == SERVING)
    _wait_for("HTTP /health 200 again", lambda: _http_health(c["http"]) == 200)
    assert _readiness(c, "front end") == (1.0, None)
    serves(c)


def test_health_is_not_serving_while_the_leader_does_not_answer(cluster):
    c = cluster
    up = c["up"]
    leader = _ranks(up)[0]
    os.kill(leader, signal.SIGSTOP)  # the channel and the admin API go silent
    try:
        _wait_for("the front end's health NOT_SERVING", lambda: _health(up.serving) == NOT_SERVING)
        _wait_for("the balancer's health NOT_SERVING", lambda: _health(up.balancer) == NOT_SERVING)
        assert _http_health(c["http"]) == 503
        assert _health(up.admin, timeout=1) in (
            grpc.StatusCode.DEADLINE_EXCEEDED,  # a stopped process
            grpc.StatusCode.UNAVAILABLE,
        )  # answers nothing
        for name in ("front end", "balancer"):
            assert _readiness(c, name) == (0.0, "leader_unreachable"), name
    finally:
        os.kill(leader, signal.SIGCONT)
    for addr in (up.serving, up.admin, up.balancer):
        _wait_for(f"{addr} SERVING again", lambda: _health(addr) == SERVING)
    serves(c)


# -- 4. clear answers ---------------------------------------------------------------------------

METHODS = {  # method -> (address key, needs the token)
    "/moeserve.v1.Serving/Generate": "serving",
    "/moeserve.v1.Serving/GenerateStream": "serving",
    "/moeserve.v1.Admin/ApplyPlacement": "admin",
    "/moeserve.v1.Admin/GetMigration": "admin",
    "/moeserve.v1.Admin/PutBalancerSettings": "admin",
    "/moeserve.v1.Admin/GetExpertLoad": "admin",
    "/moeserve.v1.Balancer/SetConfig": "balancer",
    "/moeserve.v1.Balancer/Rebalance": "balancer",
}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_malformed_protobuf_is_invalid_argument_naming_the_message(cluster, method):
    c = cluster
    address = getattr(c["up"], METHODS[method])
    with grpc.insecure_channel(address) as ch:
        stub = (ch.unary_stream if method.endswith("Stream") else ch.unary_unary)(method)
        with pytest.raises(grpc.RpcError) as e:
            r = stub(b"\xff\xff\xff\xff\x0f", timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),))
            if method.endswith("Stream"):
                list(r)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "does not parse as a moeserve.v1." in e.value.details() and "class" not in e.value.details()


@pytest.mark.parametrize(
    "suffix,content",
    [
        (".pt", b"garbage"),
        (".pt", b""),
        (".pt", b"PK\x03\x04garbage"),
        (".json", b"{not json"),
        (".json", b"\xff\xfe"),
        (".json", b'{"physical_to_logical_map": [[1, [2]]]}'),
    ],
)
def test_a_bad_placement_file_is_invalid_argument_naming_the_file(cluster, tmp_path, suffix, content):
    c = cluster
    bad = tmp_path / f"bad{suffix}"
    bad.write_bytes(content)
    before = c["admin"].placement()
    with pytest.raises(MoeserveError) as e:
        c["admin"].apply_placement(file=str(bad), file_format="sglang-pt" if suffix == ".pt" else "sglang-json")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value.message
    assert "the placement file (SGLANG_" in e.value.message and "/tmp" not in e.value.message
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moeserve",
            "placement",
            "apply",
            str(bad),
            "--address",
            c["up"].admin,
            "--admin-token",
            TOKEN,
            "--format",
            "sglang-pt" if suffix == ".pt" else "sglang-json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and f"INVALID_ARGUMENT: {bad}: the placement file" in out.stderr, out.stderr
    after = c["admin"].placement()
    assert after.version == before.version and (after.phy2log == before.phy2log).all()


# -- 3. balancer settings are validated ---------------------------------------------------------


@pytest.mark.parametrize(
    "settings,what",
    [
        (BalancerSettings(step_interval=-5), "step_interval must be an integer >= 1"),
        (BalancerSettings(step_interval=0), "step_interval must be an integer >= 1"),
        (BalancerSettings(min_balancedness=math.nan), "min_balancedness must be a number in [0, 1]"),
        (BalancerSettings(min_balancedness=math.inf), "min_balancedness must be a number in [0, 1]"),
        (BalancerSettings(min_balancedness=1.5), "min_balancedness must be a number in [0, 1]"),
        (BalancerSettings(window_steps=-1), "window_steps must be an integer in 0..1000"),
        (BalancerSettings(window_steps=10**9), "window_steps must be an integer in 0..1000"),
    ],
)
def test_bad_balancer_settings_are_refused_and_stop_nothing(cluster, settings, what):
    c = cluster
    before = c["admin"].balancer_settings()
    with pytest.raises(MoeserveError) as e:
        c["admin"].put_balancer_settings(settings)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.message, e.value.message
    assert c["admin"].balancer_settings() == before
    config = {
        k: v
        for k, v in dict(
            window_steps=settings.window_steps,
            step_interval=settings.step_interval,
            min_balancedness=settings.min_balancedness,
        ).items()
        if v is not None
    }
    with pytest.raises(MoeserveError) as e:
        c["balancer"].set_config(**config)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "must be" in e.value.message, e.value.message
    # Pause and Resume still answer, and the loop goes on.
    n = c["balancer"].balancer_status().loop_iterations
    assert c["balancer"].pause().paused and not c["balancer"].resume().paused
    _wait_for("the balancer's loop iterates", lambda: c["balancer"].balancer_status().loop_iterations > n + 2)
    assert c["balancer"].balancer_status().last_error == ""
    assert c["balancer"].set_config(step_interval=int(QUIET)).step_interval == int(QUIET)


# -- 3. recovery that says what it did ----------------------------------------------------------


def _sse_until_closed(port: int, body: dict, on_first) -> list[bytes]:
    """The data events of a streamed completion, read until the server closes the connection;
    ``on_first`` runs once the first event arrived."""
    raw = json.dumps({**body, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw
    )
    got, fired = b"", False
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
        if not fired and b"data: " in got:
            fired = True
            on_first()
    sock.close()
    return [ln[len(b"data: ") :].strip() for ln in got.split(b"\n") if ln.startswith(b"data: ")]


def test_a_front_end_stopped_mid_stream_ends_the_stream_with_an_error_event_and_done(cluster):
    """The streams of a front end that stops (SIGTERM: its grace period, 2 s here, then it is
    restarted by up) once ended without [DONE] or an error event."""
    c = cluster
    fe = c["up"].child("frontend")
    events = _sse_until_closed(
        c["http"],
        {"prompt": [5, 6, 7], "max_tokens": 4000, "temperature": 0, "ignore_eos": True},
        lambda: os.kill(fe, signal.SIGTERM),
    )
    assert events[-1] == b"[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "shutting down" in error["message"] and error["code"] == "unavailable", error
    _wait_for("a new front end", lambda: (c["up"].child("frontend") or fe) != fe and _http_health(c["http"]) == 200)
    serves(c)


def test_a_replaced_worker_says_so_on_the_console_and_in_the_leaders_metrics(cluster):
    """A replaced worker once left no line on the console and no metric."""
    c = cluster
    up = c["up"]
    worker = _ranks(up)[WORKERS]
    box: dict = {}
    streams = threading.Thread(
        target=lambda: box.update(
            out=c["serving"].generate(prompt_token_ids=c["prompt"], max_tokens=8, ignore_eos=True, timeout=120)
        )
    )
    streams.start()
    os.kill(worker, signal.SIGKILL)
    streams.join(180)
    assert box["out"].token_ids == c["want"]
    _wait_for(
        "the replacement on the console",
        lambda: re.search(
            rf"rank {WORKERS} \(worker\) exited with signal SIGKILL: starting its replacement \(restart 1 of 3",
            up.output(),
        ),
        timeout_s=60,
    )
    _wait_for("the rejoin on the console", lambda: "rejoined: the cluster runs as generation" in up.output(), 90)
    text = scrape(c["metrics"]["rank 0 (router, leader)"])
    assert samples(text, "moeserve_rank_replacements_total")[(("role", "worker"),)] == 1.0
    assert samples(text, "moeserve_ranks_lost_total")[(("role", "worker"),)] == 1.0
    assert samples(text, "moeserve_cluster_generation")[()] >= 1.0
    assert samples(text, "moeserve_ranks")[(("role", "worker"),)] == float(WORKERS)
    serves(c)
