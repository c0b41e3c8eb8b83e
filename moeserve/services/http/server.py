"""The OpenAI-compatible HTTP API (``moeserve.services.http``) on uvicorn (uvloop, httptools),
on the running event loop, with TLS when given a certificate and its key (vLLM's
``--ssl-certfile`` / ``--ssl-keyfile``: uvicorn's ``ssl_certfile`` / ``ssl_keyfile``), behind
the door's limits (``moeserve.services.http.door``: connections, header size and count,
header, body and idle timeouts).
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import TYPE_CHECKING

from moeserve.services.http.door import DoorLimits, protocol

if TYPE_CHECKING:
    import uvicorn

CUT_S = 5.0  # after the grace period: time for cut streams to send their error event and end


class HttpServer:
    """``api`` (an :class:`~moeserve.services.http.HttpApi`) on uvicorn on the running event
    loop (no signal handlers of its own: the process's owner stops it). :meth:`start` binds
    ``host:port`` (0: a free port) and returns the port; :meth:`stop` drains: new requests
    answer 503, in-flight ones get ``grace_s``, and a request still running then is cut: a stream
    gets an error event and ``data: [DONE]``, a plain answer a 503. With ``ssl_certfile`` and
    ``ssl_keyfile`` (PEM files) it serves HTTPS only: a plain-HTTP client gets no answer.
    ``door``: the connection limits (``DoorLimits``)."""

    def __init__(
        self,
        api,
        host: str = "127.0.0.1",
        port: int = 0,
        grace_s: float = 30.0,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        door: DoorLimits | None = None,
        reuse_port: bool = False,
    ):
        if bool(ssl_certfile) != bool(ssl_keyfile):
            raise ValueError("HTTPS needs both a certificate (ssl_certfile) and its key (ssl_keyfile)")
        self.api, self.host, self.port, self.grace_s = api, host, port, grace_s
        self.ssl_certfile, self.ssl_keyfile = ssl_certfile or None, ssl_keyfile or None
        self.door = door or DoorLimits()
        self.reuse_port = reuse_port  # SO_REUSEPORT: other front-end processes share the port
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"

    def _check_files(self) -> None:
        for what, f in (("certificate", self.ssl_certfile), ("key", self.ssl_keyfile)):
            assert f is not None  # called with a certificate, which __init__ pairs with its key
            if not Path(f).is_file():
                raise OSError(f"cannot serve HTTPS: the {what} {f} is not a file")

    async def start(self) -> int:
        import contextlib
        import socket
        import ssl

        import uvicorn

        class Server(uvicorn.Server):
            def capture_signals(self):  # the front end owns SIGTERM and SIGINT
                return contextlib.nullcontext()

            def install_signal_handlers(self):  # uvicorn < 0.29
                pass

        if self.ssl_certfile:
            self._check_files()
        config = uvicorn.Config(
            self.api.app,
            log_config=None,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=max(1, int(math.ceil(self.grace_s + CUT_S))),
            server_header=False,
            http=protocol(self.door),
            timeout_keep_alive=max(1, int(math.ceil(self.door.keep_alive_s))),
            ssl_certfile=self.ssl_certfile,
            ssl_keyfile=self.ssl_keyfile,
        )
        try:  # the TLS context, before the port is bound
            config.load()
        except (ssl.SSLError, ValueError) as e:
            raise OSError(f"cannot serve HTTPS with {self.ssl_certfile} and {self.ssl_keyfile}: {e}") from None
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(e.errno, f"cannot serve HTTP on {self.host}:{self.port}: {e.strerror}") from None
        sock.listen(2048)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self.server = Server(config)
        self._task = asyncio.ensure_future(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self._task.done():
                self._task.result()
                raise OSError(f"the HTTP server on {self.host}:{self.port} did not start")
            await asyncio.sleep(0.01)
        return self.port

    async def stop(self) -> None:
        self.api.draining = True
        if self.server is None or self._task is None:
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self.grace_s)
            return
        except TimeoutError:
            pass
        self.api.cut_streams(
            f"the server is shutting down: this request did not finish within its grace period ({self.grace_s:g} s)"
        )
        try:
            await asyncio.wait_for(asyncio.shield(self._task), CUT_S + 5)
        except TimeoutError:
            self.server.force_exit = True
            self._task.cancel()


__all__ = ["HttpServer"]
