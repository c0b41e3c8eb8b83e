"""``moeserve health``: a health probe for containers and scripts (exit 0 = healthy).

- ``--address HOST:PORT``: grpc.health.v1 Check of a moeserve service (front end, admin API,
  balancer); healthy when it answers SERVING. ``--service`` asks about one service name
  ("" = the server as a whole, the default).
- ``--metrics-url URL``: a process without a gRPC service (an expert-worker rank): healthy
  when its Prometheus endpoint answers 200.
"""

from __future__ import annotations

import argparse
import sys

from moeserve.cli import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "health",
        help="probe a service's health (exit 0 when healthy)",
        description="Probe grpc.health.v1 of a moeserve service, or a rank's metrics endpoint.",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--address", metavar="HOST:PORT", help="a gRPC service (grpc.health.v1)")
    what.add_argument("--metrics-url", metavar="URL", help="a Prometheus endpoint, e.g. http://127.0.0.1:9100/metrics")
    p.add_argument("--service", default="", help="the service name to ask about (default: the whole server)")
    p.add_argument("--ca-file", metavar="PEM", help="connect with TLS, trusting this CA")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S", help="deadline of the probe (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be > 0, got {args.timeout}")
    if args.metrics_url:
        return _http(args.metrics_url, args.timeout)
    return _grpc(args.address, args.service, args.ca_file, args.timeout)


def _http(url: str, timeout: float) -> int:
    import urllib.error
    import urllib.request

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--metrics-url must be an http(s) URL, got {url!r}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            ok = r.status == 200
    except (urllib.error.URLError, OSError) as e:
        print(f"unhealthy: {url}: {e}", file=sys.stderr)
        return 1
    print("healthy" if ok else f"unhealthy: {url} answered {r.status}")
    return 0 if ok else 1


def _grpc(address: str, service: str, ca_file: str | None, timeout: float) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--address must be HOST:PORT, got {address!r}")
    if ca_file:
        try:
            creds = grpc.ssl_channel_credentials(open(ca_file, "rb").read())
        except OSError as e:
            raise UsageError(f"cannot read --ca-file {ca_file}: {e.strerror}") from None
        channel = grpc.secure_channel(address, creds)
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            status = (
                health_pb2_grpc.HealthStub(channel)
                .Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
                .status
            )
        except grpc.RpcError as e:
            print(f"unhealthy: {address}: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
    print("healthy" if status == health_pb2.HealthCheckResponse.SERVING else f"unhealthy: {address} is {name}")
    return 0 if status == health_pb2.HealthCheckResponse.SERVING else 1
