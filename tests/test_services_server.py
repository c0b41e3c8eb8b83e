"""The server plumbing every service shares, against real servers on 127.0.0.1 port 0: health,
reflection, the service check, bearer tokens, message limits, deadlines, TLS and graceful stop.
A small stand-in balancer servicer keeps these tests free of a cluster."""

import asyncio
import threading
import time

import grpc
import pytest
from control_util import free_ports
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tls_util import self_signed

from moeserve.client import AsyncClient, Client, MoeserveError, _base
from moeserve.rpc import balancer_pb2, balancer_pb2_grpc
from moeserve.services.server import BALANCER, ServerOptions, ServiceServer, ThreadedServer
from moeserve.wire import SERVER_METADATA_KEY

TOKEN = "s3cret"


class StandIn(balancer_pb2_grpc.BalancerServicer):
    def __init__(self):
        self.rebalances = 0

    async def Rebalance(self, request, context):  # as the balancer does when the admin API is away
        self.rebalances += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the admin API answered UNAVAILABLE")

    async def GetBalancerStatus(self, request, context):
        return balancer_pb2.BalancerStatus(state="idle")

    async def SetConfig(self, request, context):  # sleeps step_interval milliseconds
        await asyncio.sleep(request.step_interval / 1000)
        return balancer_pb2.BalancerStatus(step_interval=request.step_interval)


def start(**opts) -> ThreadedServer:
    """A stand-in balancer server; its servicer is ``.stand_in``."""
    stand_in = StandIn()

    def add(server):
        balancer_pb2_grpc.add_BalancerServicer_to_server(stand_in, server)

    srv = ThreadedServer(ServiceServer(BALANCER, add, ServerOptions(**{"token": TOKEN, "grace_s": 5.0, **opts})))
    srv.start()
    srv.stand_in = stand_in
    return srv


@pytest.fixture(scope="module")
def server():
    srv = start(max_message_bytes=4096)
    yield srv
    srv.stop()


def addr(srv) -> str:
    return f"127.0.0.1:{srv.server.port}"


@pytest.mark.timeout(60)
def test_health_answers_serving_without_a_token(server):
    with grpc.insecure_channel(addr(server)) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", BALANCER):
            assert (
                stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                == health_pb2.HealthCheckResponse.SERVING
            )


@pytest.mark.timeout(60)
def test_reflection_lists_the_service_health_and_reflection(server):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(addr(server)) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
    assert {BALANCER, "grpc.health.v1.Health"} <= services


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token,match", [(None, "needs a bearer token"), ("wrong", "wrong bearer token")])
def test_a_call_without_the_right_token_is_unauthenticated(server, token, match, monkeypatch):
    monkeypatch.delenv("MOESERVE_ADMIN_TOKEN", raising=False)
    with pytest.raises(MoeserveError) as e:
        Client(addr(server), token=token).balancer_status()
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert match in e.value.message
    assert Client(addr(server), token=TOKEN).balancer_status().state == "idle"


@pytest.mark.timeout(60)
def test_a_method_of_another_service_is_unimplemented_and_names_the_right_one(server):
    c = Client(addr(server), token=TOKEN)
    with pytest.raises(MoeserveError) as e:
        c.placement()
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert "admin API" in e.value.message and "--admin-port" in e.value.message and "--balancer-port" in e.value.message
    with pytest.raises(MoeserveError) as e:  # a streaming method too
        list(c.generate_stream(prompt_token_ids=[1], max_tokens=1))
    assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and "--port" in e.value.message


@pytest.mark.timeout(60)
def test_an_oversized_message_is_refused_and_the_server_goes_on(server):
    with grpc.insecure_channel(addr(server)) as ch:
        raw = ch.unary_unary(
            f"/{BALANCER}/GetBalancerStatus", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.RpcError) as e:
            raw(b"\x00" * 10_000, timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details() and "4096" in e.value.details()
    assert Client(addr(server), token=TOKEN).balancer_status().state == "idle"


@pytest.mark.timeout(60)
def test_a_deadline_is_honoured(server):
    with pytest.raises(MoeserveError) as e:
        Client(addr(server), token=TOKEN, timeout=0.2).set_config(step_interval=2000)
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.timeout(60)
def test_the_async_client_has_the_same_methods_and_works(server):
    public = lambda cls: {m for m in dir(cls) if not m.startswith("_")}
    assert public(AsyncClient) - {"__aenter__", "__aexit__"} == public(Client) - {"__enter__", "__exit__"}

    async def go():
        async with AsyncClient(addr(server), token=TOKEN) as c:
            return (await c.set_config(step_interval=7)).step_interval

    assert asyncio.run(go()) == 7


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@pytest.mark.timeout(60)
def test_stop_goes_not_serving_first_and_lets_in_flight_calls_finish():
    srv = start()
    seen, result = [], {}
    ch = grpc.insecure_channel(addr(srv))
    watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=BALANCER))

    def follow():
        try:
            for r in watch:
                seen.append(r.status)
        except grpc.RpcError:
            pass

    threading.Thread(target=follow, daemon=True).start()
    slow = threading.Thread(
        target=lambda: result.update(status=Client(addr(srv), token=TOKEN).set_config(step_interval=1500)), daemon=True
    )
    slow.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    srv.stop()  # grace 5 s
    slow.join(10)
    assert result["status"].step_interval == 1500  # the in-flight call finished
    assert time.monotonic() - t0 < 5 + 2  # open Watch streams are cut at the grace period
    assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
    with pytest.raises(MoeserveError) as e:
        Client(addr(srv), token=TOKEN, timeout=2).balancer_status()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    ch.close()


@pytest.mark.timeout(60)
def test_tls_serves_clients_that_trust_the_ca_and_no_plaintext_ones(tmp_path):
    cert, key = self_signed(tmp_path)
    srv = start(tls_cert=cert, tls_key=key)
    try:
        assert Client(addr(srv), token=TOKEN, ca_file=cert).balancer_status().state == "idle"
        with pytest.raises(MoeserveError) as e:
            Client(addr(srv), token=TOKEN, timeout=2).balancer_status()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(tls_cert="c.pem"), "both a certificate and a key"),
        (dict(port=70000), "port"),
        (dict(max_message_bytes=10), "max_message_bytes"),
        (dict(token=""), "token"),
    ],
)
def test_bad_server_options_say_what_is_allowed(kw, match):
    with pytest.raises(ValueError, match=match):
        ServerOptions(**kw)


# -- retries: only a call that reached no server is sent again ------------------------------------

PAUSES = (0.2, 0.2, 0.2)


@pytest.fixture
def pauses(monkeypatch):
    monkeypatch.setattr(_base, "RETRY_DELAYS_S", PAUSES)


@pytest.mark.timeout(60)
def test_every_answer_carries_the_servers_mark_aborted_ones_too(server):
    mark = (SERVER_METADATA_KEY, BALANCER)
    with grpc.insecure_channel(addr(server)) as ch:
        stub = balancer_pb2_grpc.BalancerStub(ch)
        _, call = stub.GetBalancerStatus.with_call(
            balancer_pb2.GetBalancerStatusRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert mark in tuple(call.trailing_metadata())
        for auth in ((), (("authorization", f"Bearer {TOKEN}"),)):  # refused by the token check; by the handler
            with pytest.raises(grpc.RpcError) as e:
                stub.Rebalance(balancer_pb2.RebalanceRequest(), timeout=5, metadata=auth)
            assert mark in tuple(e.value.trailing_metadata()), e.value


@pytest.mark.timeout(60)
def test_an_unavailable_the_server_answered_is_not_repeated(server, pauses):
    async def aio():
        async with AsyncClient(addr(server), token=TOKEN) as c:
            with pytest.raises(MoeserveError) as e:
                await c.rebalance()
            return e.value

    n = server.stand_in.rebalances
    with pytest.raises(MoeserveError) as e:
        Client(addr(server), token=TOKEN).rebalance()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE and "admin API answered" in e.value.message
    assert server.stand_in.rebalances == n + 1
    err = asyncio.run(aio())
    assert err.code == grpc.StatusCode.UNAVAILABLE and server.stand_in.rebalances == n + 2


@pytest.mark.timeout(60)
def test_a_call_that_reached_no_server_is_retried_after_every_pause(pauses):
    (port,) = free_ports(1)  # nothing listens there
    c = Client(f"127.0.0.1:{port}", token=TOKEN, timeout=5)

    async def aio():
        async with AsyncClient(f"127.0.0.1:{port}", token=TOKEN, timeout=5) as a:

            async def stream():
                return [x async for x in a.generate_stream(prompt_token_ids=[1])]

            for call in (a.rebalance, stream):
                t0 = time.monotonic()
                with pytest.raises(MoeserveError) as e:
                    await call()
                assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 >= sum(PAUSES)

    for call in (c.rebalance, lambda: list(c.generate_stream(prompt_token_ids=[1]))):  # not idempotent: still safe
        t0 = time.monotonic()
        with pytest.raises(MoeserveError) as e:
            call()
        assert e.value.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 >= sum(PAUSES)
    asyncio.run(aio())
