"""The balancer survives the admin API being away: its loop keeps turning, says why it cannot
work, and picks up again (with the settings kept on the leader) once the admin API answers."""

import asyncio
import time

import pytest
from control_util import free_ports

from moeserve.balancer.controller import LoopConfig
from moeserve.balancer.service import BalancerService
from moeserve.client import AsyncClient, Client
from moeserve.rpc import admin_pb2, admin_pb2_grpc, balancer_pb2_grpc
from moeserve.services.server import ADMIN, BALANCER, ServerOptions, ServiceServer, ThreadedServer
from moeserve.wire import int64_matrix

TOKEN = "t"


class StandInAdmin(admin_pb2_grpc.AdminServicer):
    """An idle leader: no load yet; keeps the balancer's settings like the real one."""

    def __init__(self):
        self.settings = admin_pb2.BalancerSettings(step_interval=77, paused=True)

    async def GetBalancerSettings(self, request, context):
        return self.settings

    async def PutBalancerSettings(self, request, context):
        self.settings = request
        return request

    async def GetExpertLoad(self, request, context):
        import numpy as np

        return admin_pb2.ExpertLoad(
            load=int64_matrix(np.zeros((2, 4))), worker_load=int64_matrix(np.zeros((2, 2))), window_size=100
        )


def serve(service_name, servicer, add, port) -> ThreadedServer:
    srv = ThreadedServer(
        ServiceServer(service_name, lambda s: add(servicer, s), ServerOptions(port=port, token=TOKEN, grace_s=1))
    )
    srv.start()
    return srv


def wait_for(pred, timeout_s=20):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow  # long-running (several seconds on 2 cores): out of the fast loop
@pytest.mark.timeout(60)
def test_the_loop_outlives_an_admin_outage_and_resumes_with_the_settings_kept_on_the_leader():
    (admin_port,) = free_ports(1)

    async def make_client():
        return AsyncClient(f"127.0.0.1:{admin_port}", TOKEN, timeout=1)

    holder = {}

    def add(service, server):
        balancer_pb2_grpc.add_BalancerServicer_to_server(service, server)

    holder["service"] = BalancerService(None, LoopConfig(step_interval=10), poll_s=0.05)
    bal_srv = ThreadedServer(
        ServiceServer(BALANCER, lambda s: add(holder["service"], s), ServerOptions(token=TOKEN, grace_s=1))
    )
    bal_srv.start()
    holder["service"].admin = bal_srv.submit(make_client()).result(10)  # made on the server's loop
    bal_srv.loop.call_soon_threadsafe(holder["service"].start)
    b = Client(f"127.0.0.1:{bal_srv.server.port}", TOKEN)
    admin_srv = None
    try:
        wait_for(lambda: b.balancer_status().loop_iterations > 3)
        st = b.balancer_status()
        assert not st.admin_reachable and "UNAVAILABLE" in st.last_error
        admin_srv = serve(ADMIN, StandInAdmin(), admin_pb2_grpc.add_AdminServicer_to_server, admin_port)
        wait_for(lambda: b.balancer_status().admin_reachable)
        st = b.balancer_status()
        assert st.last_error == "" and st.paused and st.step_interval == 77  # from the leader
        n = st.loop_iterations
        wait_for(lambda: b.balancer_status().loop_iterations > n + 3)
    finally:
        bal_srv.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(holder["service"].stop()))
        bal_srv.stop()
        if admin_srv:
            admin_srv.stop()
