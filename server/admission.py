"""Fair shares per client: who a caller is (its bearer token, or its peer's host) and what each may hold open."""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Callable, Optional

UNKNOWN = "unknown"


def share(explicit: Optional[int], total: int) -> int:
    """A per-client limit: the one given, never above its server-wide `total`; none given: half of it."""
    return max(1, min(explicit, total) if explicit else total // 2)


@dataclass(frozen=True)
class ClientLimits:
    """Per-client bounds beside the server-wide ones (each refused with RESOURCE_EXHAUSTED naming its flag).

    Each defaults to half of its server-wide limit and is never above it (`resolved`), so no single
    client locks the others out; a server with one trusted trainer can raise them to the server-wide
    values."""

    max_streams: Optional[int] = None     # Forward streams one client holds open (--max-streams-per-client)
    max_in_flight: Optional[int] = None   # requests in flight for one client, every front-end (--max-in-flight-per-client)
    stream_idle_s: float = 300.0          # a Forward stream with nothing in flight this long is closed (--stream-idle-s)
    max_in_flight_total: int = 2048       # requests in flight server-wide, every front-end (--max-in-flight)

    def __post_init__(self):
        explicit = [v for v in (self.max_streams, self.max_in_flight) if v is not None]
        if any(v < 1 for v in explicit) or not self.stream_idle_s > 0 or self.max_in_flight_total < 1:
            raise ValueError(f"per-client limits must be positive: {self}")

    def resolved(self, max_streams_total: int) -> "ClientLimits":
        """The effective limits: each per-client one given or derived from its server-wide limit."""
        return ClientLimits(share(self.max_streams, max_streams_total),
                            share(self.max_in_flight, self.max_in_flight_total), self.stream_idle_s,
                            self.max_in_flight_total)


def _host_of(peer: str) -> str:
    """'ipv4:10.0.0.5:41234' -> '10.0.0.5', 'ipv6:[::1]:5' -> '::1', 'unix:/p' -> 'unix:/p'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer or UNKNOWN


def client_key(authorization: str, host: str, by_token: bool) -> str:
    """A caller's identity for fair shares. With tokens configured (`by_token`: --auth-token-file), its bearer
    token, checked before any work, as a short hash (logs never show a token); without them a bearer header
    proves nothing and anyone could make up one per request, so a caller is the host it connects from (every
    connection and port of a host is one client), on every front-end."""
    scheme, _, token = (authorization or "").partition(" ")
    if by_token and scheme.lower() == "bearer" and token.strip():
        return "token:" + hashlib.sha256(token.strip().encode()).hexdigest()[:12]
    return "peer:" + (host or UNKNOWN)


def client_of(context, by_token: bool) -> str:
    """client_key of a gRPC call (the HTTP front-end passes its header and peer host itself)."""
    authorization = next((v for k, v in context.invocation_metadata() or () if k == "authorization"), "")
    try:
        host = _host_of(context.peer() or "")
    except Exception:   # noqa: BLE001 (a context without a peer: one shared identity)
        host = UNKNOWN
    return client_key(authorization, host, by_token)


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
    """Who a caller is, and its streams and requests in flight; `open_stream`/`start` return a refusal or None."""

    def __init__(self, limits: ClientLimits, by_token: bool = False):
        self.limits = limits               # resolved: every per-client limit a number
        self.by_token = by_token           # tokens are configured: a bearer token is an identity
        self._lock = threading.Lock()
        self._streams = Tally()
        self._in_flight = Tally()

    def of_grpc(self, context) -> str:
        return client_of(context, self.by_token)

    def of_http(self, authorization: str, host: str) -> str:
        return client_key(authorization, host, self.by_token)

    def _take(self, tally: Tally, client: str, limit: int, refusal: Callable[[int], str],
              total: Optional[int] = None, total_refusal: Optional[Callable[[int], str]] = None) -> Optional[str]:
        with self._lock:
            if total is not None and tally.total >= total:
                return total_refusal(tally.total)
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
        """A request of `client` is in flight from now on (every front-end), unless over a limit."""
        limit, total = self.limits.max_in_flight, self.limits.max_in_flight_total
        return self._take(self._in_flight, client, limit, lambda n: (
            f"requests in flight: this client ({client}) has {n}, the server's --max-in-flight-per-client is "
            f"{limit}; wait for some to finish"), total, lambda n: (
            f"requests in flight: {n} on this server, its --max-in-flight is {total}; retry later"))

    def end(self, client: str) -> None:
        with self._lock:
            self._in_flight.remove(client)
