"""The HTTP front door's limits, enforced on the connection before a request reaches the app:
uvicorn's httptools protocol with a byte budget and a deadline for each part of a request.

Per connection, in order:

- **connections**: at most ``max_connections`` open at once (uvicorn's ``--limit-concurrency``);
  one more is answered 503 and closed before a byte of it is read;
- **idle**: a connection with no request in progress (just opened, or between keep-alive
  requests) is closed after ``keep_alive_s`` (uvicorn's ``--timeout-keep-alive``; uvicorn
  itself only times the wait between requests, so a connection that never sends stays open);
- **headers**: the request line and headers must arrive within ``header_timeout_s`` of their
  first byte (408 otherwise: a slowloris client holds a connection for at most that long),
  in at most ``max_header_bytes`` bytes and ``max_header_count`` fields (431 Request Header
  Fields Too Large, read no further: a 64 MB header line costs the front end 64 KiB);
- **body**: the body must arrive within ``body_timeout_s`` of the headers (408); its size is
  the app's (413 over ``--max-message-bytes``, on the Content-Length before it is read).

Every refusal is an OpenAI error body with ``connection: close``.
"""

from __future__ import annotations

import asyncio
import functools
import http
import json
from dataclasses import dataclass

ERROR_TYPES = {408: "invalid_request_error", 431: "invalid_request_error", 503: "service_unavailable"}


@dataclass(frozen=True)
class DoorLimits:
    """The HTTP door's limits (defaults; each has a flag, ``moeserve.cli.flags.add_http_flags``)."""

    max_header_bytes: int = 64 << 10  # --h11-max-incomplete-event-size (uvicorn's and vLLM's name)
    max_header_count: int = 256  # --h11-max-header-count (vLLM's name)
    header_timeout_s: float = 10.0  # --http-header-timeout
    body_timeout_s: float = 30.0  # --http-body-timeout
    keep_alive_s: float = 5.0  # --timeout-keep-alive (uvicorn's name)
    max_connections: int = 1024  # --limit-concurrency (uvicorn's name)

    def __post_init__(self):
        for name in ("max_header_bytes", "max_header_count", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def refusal(status: int, message: str) -> bytes:
    """A whole HTTP response in OpenAI's error shape that closes the connection."""
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "invalid_request_error"),
                "param": None,
                "code": None,
            }
        }
    ).encode()
    return b"".join(
        [
            f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode(),
            b"content-type: application/json\r\n",
            b"content-length: " + str(len(body)).encode() + b"\r\n",
            b"connection: close\r\n\r\n",
            body,
        ]
    )


IDLE, HEAD, BODY, RESPOND = range(4)  # where a connection is in its current request


@functools.cache
def _guarded():
    """The protocol class (defined on first use: uvicorn is imported only by a process that serves HTTP)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol under :class:`DoorLimits` (``limits``, set by :func:`protocol`)."""

        limits: DoorLimits = DoorLimits()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive = self.limits.keep_alive_s  # type: ignore[assignment]  # seconds: a float works
            self._state = IDLE
            self._head_bytes = 0
            self._fields = 0
            self._timer: asyncio.TimerHandle | None = None
            self._refused = False
            if len(self.connections) > self.limits.max_connections:
                self._refuse(503, f"this server holds {self.limits.max_connections} connections already; retry later")
                return
            self._arm_idle()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        # -- timers ---------------------------------------------------------------------------------

        def _disarm(self) -> None:
            timer = getattr(self, "_timer", None)
            if timer is not None:
                timer.cancel()
                self._timer = None

        def _arm(self, seconds: float, on_expiry) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, on_expiry)

        def _arm_idle(self) -> None:
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(
                self.limits.keep_alive_s, self.timeout_keep_alive_handler
            )

        def _head_expired(self) -> None:
            self._timer = None
            if self._state == HEAD:
                self._refuse(408, f"the request headers did not arrive within {self.limits.header_timeout_s:g} s")

        def _body_expired(self) -> None:
            self._timer = None
            if self._state != BODY:
                return
            cycle = self.cycle
            if cycle is not None and not cycle.response_started:
                self._refuse(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s")
            else:
                self.transport.close()
            if cycle is not None:  # the app's receive() answers http.disconnect
                cycle.disconnected = True
                cycle.message_event.set()

        def _refuse(self, status: int, message: str) -> None:
            self._refused = True
            self._disarm()
            self._unset_keepalive_if_required()
            if not self.transport.is_closing():
                self.transport.write(refusal(status, message))
                self.transport.close()

        # -- parsing --------------------------------------------------------------------------------

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._state == IDLE:
                self._state, self._head_bytes, self._fields = HEAD, 0, 0
                self._arm(self.limits.header_timeout_s, self._head_expired)
            if self._state != HEAD:
                super().data_received(data)
                return
            room = self.limits.max_header_bytes - self._head_bytes
            head, rest = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._head_bytes += len(head)
            super().data_received(head)
            if rest and not self._refused:
                if self._state == HEAD:  # still no end of the headers, and no room left
                    self._refuse(
                        431, f"the request line and headers are larger than {self.limits.max_header_bytes} bytes"
                    )
                else:
                    super().data_received(rest)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._fields += 1
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refused:
                return
            if self._fields > self.limits.max_header_count:
                self._refuse(
                    431, f"the request has {self._fields} header fields; at most {self.limits.max_header_count}"
                )
                return
            self._state = BODY
            self._arm(self.limits.body_timeout_s, self._body_expired)
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._state = RESPOND
            self._disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if self._state == RESPOND:
                self._state = IDLE
            super().on_response_complete()

    return GuardedProtocol


def protocol(limits: DoorLimits) -> type:
    """The protocol class uvicorn instantiates per connection (``Config(http=...)``): uvicorn's
    httptools protocol under ``limits``."""
    return type("GuardedProtocol", (_guarded(),), {"limits": limits})


__all__ = ["DoorLimits", "protocol", "refusal"]
