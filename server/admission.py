"""Fair shares per client: who a caller is (its bearer token, or its peer's host) and what each may hold open."""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Optional

UNKNOWN = "unknown"


@dataclass(frozen=True)
class ClientLimits:
    """Per-client bounds beside the server-wide ones (each refused with RESOURCE_EXHAUSTED naming its flag).

    The defaults let one client use half of each server-wide resource, so no single client locks
    the others out; a server with one trusted trainer can raise them to the server-wide values."""

    max_streams: int = 128          # Forward streams one client holds open (--max-streams-per-client)
    max_in_flight: int = 1024       # requests in flight for one client: every stream and KServe (--max-in-flight-per-client)
    stream_idle_s: float = 300.0    # a Forward stream with nothing in flight this long is closed (--stream-idle-s)

    def __post_init__(self):
        if self.max_streams < 1 or self.max_in_flight < 1 or not self.stream_idle_s > 0:
            raise ValueError(f"per-client limits must be positive: {self}")


def _host_of(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> '10.0.0.5', 'ipv6:[::1]:5' -> '::1', 'unix:/p' -> 'unix:/p'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer or UNKNOWN


def client_of(context) -> str:
    """A caller's identity for fair shares: its bearer token (as a short hash: logs never show a token), or,
    without one, the host it connects from (every connection and port of a host is one client)."""
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:12]
    try:
        return "peer:" + _host_of(context.peer() or "")
    except Exception:   # noqa: BLE001 (a context without a peer: one shared identity)
        return UNKNOWN


class Clients:
    """Streams and requests in flight per client; `open_stream`/`start` return a refusal message or None."""

    def __init__(self, limits: ClientLimits = ClientLimits()):
        self.limits = limits
        self._lock = threading.Lock()
        self._streams: dict[str, int] = {}
        self._in_flight: dict[str, int] = {}

    def open_stream(self, client: str) -> Optional[str]:
        with self._lock:
            n = self._streams.get(client, 0)
            if n >= self.limits.max_streams:
                return (f"streams: this client ({client}) holds {n} open, the server's --max-streams-per-client "
                        f"is {self.limits.max_streams}; share a stream or close idle ones")
            self._streams[client] = n + 1
            return None

    def close_stream(self, client: str) -> None:
        with self._lock:
            _decrement(self._streams, client)

    def start(self, client: str) -> Optional[str]:
        with self._lock:
            n = self._in_flight.get(client, 0)
            if n >= self.limits.max_in_flight:
                return (f"requests in flight: this client ({client}) has {n}, the server's "
                        f"--max-in-flight-per-client is {self.limits.max_in_flight}; wait for some to finish")
            self._in_flight[client] = n + 1
            return None

    def end(self, client: str) -> None:
        with self._lock:
            _decrement(self._in_flight, client)

    def snapshot(self) -> dict[str, tuple[int, int]]:
        """client -> (streams, requests in flight), for metrics and tests."""
        with self._lock:
            names = set(self._streams) | set(self._in_flight)
            return {c: (self._streams.get(c, 0), self._in_flight.get(c, 0)) for c in names}


def _decrement(counts: dict[str, int], client: str) -> None:
    n = counts.get(client, 0) - 1
    if n > 0:
        counts[client] = n
    else:
        counts.pop(client, None)
