"""HTTP connections under hostile clients: bounded in number (server-wide and per host), read and write deadlines.

uvicorn's h11 protocol serves the requests; this subclass only guards the connection around them:
- At most `max_connections` open connections, and `max_connections_per_client` per peer host (a host
  is one client whatever its ports, as for gRPC without tokens; the count is taken at accept time,
  before any byte is read, so a bearer header cannot matter). One over gets a 503 and is closed at
  once: thousands of idle sockets never exhaust the process's file descriptors, and gRPC, which shares
  them, keeps answering.
- A request's line and headers must arrive within `header_timeout_s` of the connection opening or the
  previous answer ending, its body within `body_timeout_s` of its headers (headers sent a byte at a time
  are cut too); an idle keep-alive connection closes after `keepalive_s`; a connection serves at most
  `max_requests_per_connection` requests.
- A reader that does not take the answer's bytes (the transport's buffer stays over its high-water mark)
  for `send_timeout_s` is aborted: its request ends and every byte it held is freed.
- asyncio's "accept() out of system resource" errors are logged at most once per `LOG_EVERY_S`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

from .admission import Tally, share

log = logging.getLogger("logitserve.http")
LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP port's connection bounds (each a --http-* flag)."""

    max_connections: int = 1024                 # open connections, server-wide (--http-max-connections)
    max_connections_per_client: Optional[int] = None   # per peer host; none: half of max_connections
    header_timeout_s: float = 10.0              # request line + headers (--http-header-timeout-s)
    body_timeout_s: float = 30.0                # the body, from its headers on (--http-body-timeout-s)
    keepalive_s: float = 5.0                    # an idle kept-alive connection closes (--http-keepalive-s)
    max_requests_per_connection: int = 1000     # then its answer says 'connection: close' and it closes
                                                # (--http-max-requests-per-connection)
    send_timeout_s: float = 30.0                # a reader that takes no bytes this long loses its request

    def __post_init__(self):
        times = (self.header_timeout_s, self.body_timeout_s, self.keepalive_s, self.send_timeout_s)
        if self.max_connections < 1 or not all(t > 0 for t in times) or self.max_requests_per_connection < 1:
            raise ValueError(f"HTTP limits must be positive: {self}")
        if self.max_connections_per_client is not None and self.max_connections_per_client < 1:
            raise ValueError(f"--http-max-connections-per-client must be >= 1: {self.max_connections_per_client}")

    @property
    def per_client(self) -> int:
        return share(self.max_connections_per_client, self.max_connections)

    def describe(self) -> str:
        return (f"--http-max-connections {self.max_connections} (per client {self.per_client}), header/body/send "
                f"timeouts {self.header_timeout_s:g}/{self.body_timeout_s:g}/{self.send_timeout_s:g} s, keep-alive "
                f"{self.keepalive_s:g} s, {self.max_requests_per_connection} requests per connection")


class RateLimitedLog:
    """One log line per interval for a repeating event, with how many were not logged."""

    def __init__(self, every_s: float = LOG_EVERY_S):
        self._every, self._last, self._quiet = every_s, float("-inf"), 0
        self._lock = threading.Lock()

    def ready(self) -> Optional[int]:
        """None: stay quiet; else log now (the number of events not logged since the last line)."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self._every:
                self._quiet += 1
                return None
            self._last, quiet, self._quiet = now, self._quiet, 0
            return quiet


class AcceptErrorFilter(logging.Filter):
    """asyncio logs every failed accept() with a traceback (EMFILE): let one through per interval."""

    def __init__(self):
        super().__init__()
        self._gate = RateLimitedLog()

    def filter(self, record: logging.LogRecord) -> bool:
        if "accept" not in str(record.msg):
            return True
        quiet = self._gate.ready()
        if quiet is None:
            return False
        record.exc_info = None          # the cause is in the message; no traceback per socket
        record.msg = f"{record.msg} ({quiet} more not logged in the last {LOG_EVERY_S:g} s)"
        return True


class Connections:
    """Open HTTP connections by peer host, and the refusals past the limits."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.open = Tally()
        self.refused = 0
        self._log = RateLimitedLog()

    def admit(self, host: str) -> Optional[str]:
        """None (counted as open from now on), or why the connection is refused."""
        lim = self.limits
        if self.open.total >= lim.max_connections:
            why = f"{self.open.total} HTTP connections are open, the server's --http-max-connections is " \
                  f"{lim.max_connections}"
        elif self.open.of(host) >= lim.per_client:
            why = f"this client ({host}) holds {self.open.of(host)} HTTP connections open, the server's " \
                  f"--http-max-connections-per-client is {lim.per_client}"
        else:
            self.open.add(host)
            return None
        self.refused += 1
        quiet = self._log.ready()
        if quiet is not None:
            log.warning("refusing HTTP connections: %s (%d more refused in the last %g s)", why, quiet, LOG_EVERY_S)
        return why


def _refusal_bytes(why: str) -> bytes:
    body = orjson.dumps({"error": {"message": why + "; retry later", "type": "ServiceUnavailable", "param": None,
                                   "code": 503}})
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: %d\r\n\r\n" % len(body)) + body


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, the connection guarded by `guard` (set on the subclass guarded_protocol
    makes): admitted at accept, deadlines for headers, body and a stalled reader."""

    guard: Connections      # not `connections`: H11Protocol has its own (the server's set of them)
    _host: Optional[str] = None
    _timer: Optional[asyncio.TimerHandle] = None
    _send_timer: Optional[asyncio.TimerHandle] = None
    _seen = None                       # the request cycle whose headers we last saw
    _served = 0

    @property
    def _limits(self) -> HttpLimits:
        return self.guard.limits

    def connection_made(self, transport) -> None:
        peer = transport.get_extra_info("peername")
        host = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        why = self.guard.admit(host)
        if why is not None:
            transport.write(_refusal_bytes(why))
            transport.close()
            return
        self._host = host
        super().connection_made(transport)
        self._arm(self._limits.header_timeout_s, "its request line and headers")

    def connection_lost(self, exc) -> None:
        if self._host is None:         # refused at accept: never served
            return
        self.guard.open.remove(self._host)
        self._host = None
        self._disarm()
        self._cancel_send_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen:        # a new request's headers are in
            self._seen = cycle
            self._served += 1
            if self._served >= self._limits.max_requests_per_connection:
                cycle.keep_alive = False
                # and the answer says so: uvicorn adds 'connection: close' to an answer whose request carried it
                # (without the header a client reuses the closed socket: a broken pipe on its next request)
                cycle.scope["headers"] = [*cycle.scope["headers"], (b"connection", b"close")]
            self._arm(self._limits.body_timeout_s, "its body")
        if cycle is not None and not cycle.more_body:             # the whole request is in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()     # uvicorn's keep-alive timer closes an idle connection
        if not self.transport.is_closing():
            self._arm(self._limits.header_timeout_s, "its next request's line and headers")

    # -- deadlines ------------------------------------------------------------------------------------
    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire, what, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, what: str, seconds: float) -> None:
        self._timer = None
        c = self.cycle
        between = c is None or c.response_complete                       # waiting for the next request
        in_body = c is not None and c is self._seen and c.more_body and not c.response_started
        if not (between or in_body):      # a request is being answered (or a pipelined one waits)
            return
        log.debug("HTTP connection from %s closed: %s did not arrive within %g s", self._host, what, seconds)
        self.transport.abort()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self._limits.send_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_send_timer()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _stalled(self) -> None:
        self._send_timer = None
        log.warning("HTTP client %s took no bytes of its answer for %g s (--http-send-timeout-s): connection "
                    "closed, its request ended", self._host, self._limits.send_timeout_s)
        self.transport.abort()


def guarded_protocol(connections: Connections) -> type:
    """A GuardedH11 class bound to `connections` (uvicorn builds one per connection from Config(http=...))."""
    return type("Guarded", (GuardedH11,), {"guard": connections})
