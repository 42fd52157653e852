"""Fair shares per client: who a caller is (its bearer token, or its peer's host) and what each may hold open."""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable, Optional

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


def client_key(authorization: str, host: str) -> str:
    """A caller's identity for fair shares: its bearer token (as a short hash: logs never show a token), or,
    without one, the host it connects from (every connection and port of a host is one client)."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:12]
    return "peer:" + (host or UNKNOWN)


def client_of(context) -> str:
    """client_key of a gRPC call (the HTTP front-end passes its header and peer host itself)."""
    authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
    try:
        host = _host_of(context.peer() or "")
    except Exception:   # noqa: BLE001 (a context without a peer: one shared identity)
        host = UNKNOWN
    return client_key(authorization, host)


class Tally:
    """A quantity held server-wide and per client (its callers hold their own lock)."""

    def __init__(self):
        self.total = 0
        self._by: dict[str, int] = {}

    def of(self, client: str) -> int:
        return self._by.get(client, 0)

    def add(self, client: str, n: int = 1) -> None:
        self.total += n
        self._by[client] = self.of(client) + n

    def remove(self, client: str, n: int = 1) -> None:
        self.total -= n
        left = self.of(client) - n
        if left > 0:
            self._by[client] = left
        else:
            self._by.pop(client, None)


class Clients:
    """Streams and requests in flight per client; `open_stream`/`start` return a refusal message or None."""

    def __init__(self, limits: ClientLimits = ClientLimits()):
        self.limits = limits
        self._lock = threading.Lock()
        self._streams = Tally()
        self._in_flight = Tally()

    def _take(self, tally: Tally, client: str, limit: int, refusal: Callable[[int], str]) -> Optional[str]:
        with self._lock:
            n = tally.of(client)
            if n >= limit:
                return refusal(n)
            tally.add(client)
            return None

    def open_stream(self, client: str) -> Optional[str]:
        limit = self.limits.max_streams
        return self._take(self._streams, client, limit, lambda n: (
            f"streams: this client ({client}) holds {n} open, the server's --max-streams-per-client is {limit}; "
            f"share a stream or close idle ones"))

    def close_stream(self, client: str) -> None:
        with self._lock:
            self._streams.remove(client)

    def start(self, client: str) -> Optional[str]:
        limit = self.limits.max_in_flight
        return self._take(self._in_flight, client, limit, lambda n: (
            f"requests in flight: this client ({client}) has {n}, the server's --max-in-flight-per-client is "
            f"{limit}; wait for some to finish"))

    def end(self, client: str) -> None:
        with self._lock:
            self._in_flight.remove(client)
