"""One replica of a TeacherPool: its client, its health as its Watch stream reports it, its load, its model."""
from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from dataclasses import dataclass
from typing import Callable, Optional

from .aio import AsyncTeacherClient
from .api import ModelInfo
from .errors import LogitServeError
from .health import UNREACHABLE, Watcher

log = logging.getLogger("logitserve.client.pool")


@dataclass(frozen=True)
class ReplicaState:
    address: str
    status: str            # SERVING | NOT_SERVING | UNREACHABLE | CONNECTING | REFUSED (another model) | REMOVED
    in_flight: int         # sequences this client has in flight there
    sent: int              # sequences sent there, in all (resends included)
    content_hash: str      # "" until its ModelInfo arrived
    history: tuple         # ((time.monotonic(), status), ...): its last 16 changes of status


class Replica:
    """Routable while its Watch says SERVING, its ModelInfo arrived and its weights are the pool's."""

    def __init__(self, address: str, options: dict, admit: Callable[["Replica", ModelInfo], None],
                 changed: Callable[[], None]):
        self.address = address
        self.client = AsyncTeacherClient(address, **options)
        self.health = "CONNECTING"
        self.info: Optional[ModelInfo] = None
        self.refused: Optional[str] = None       # why its model was refused
        self.removed = False
        self.in_flight = self.sent = 0
        self.history: collections.deque = collections.deque(maxlen=16)
        self._admit, self._changed = admit, changed
        self.watcher = Watcher(self.client.channel, self.client.metadata, self._on_status)

    @property
    def routable(self) -> bool:
        return self.health == "SERVING" and self.info is not None and self.refused is None and not self.removed

    def state(self) -> ReplicaState:
        status = "REMOVED" if self.removed else "REFUSED" if self.refused else self.health
        return ReplicaState(self.address, status, self.in_flight, self.sent,
                            self.info.content_hash if self.info else "", tuple(self.history))

    def describe(self) -> str:
        return f"{self.address}: {self.state().status}" + (f" ({self.refused})" if self.refused else "")

    def lost(self) -> None:
        """A request found it gone before its Watch stream did: out until the stream re-states SERVING."""
        if self.health == "SERVING":
            self._set(UNREACHABLE)
            self.watcher.restart()

    async def _on_status(self, status: str) -> None:
        if status == "SERVING" and not self.routable:
            try:   # its model, before the first request: a replica restarted on other weights is caught here
                info = await self.client.model_info(timeout=10.0)
            except LogitServeError as e:
                log.warning("replica %s says SERVING but ModelInfo failed (%s); watching again", self.address, e)
                self.watcher.restart()
                return
            self.info, self.refused = info, None
            self._admit(self, info)
        elif status != "SERVING":
            self.info = None
        self._set(status)

    def _set(self, status: str) -> None:
        if status != self.health:
            self.health = status
            self.history.append((time.monotonic(), status))
            log.info("replica %s: %s", self.address, status)
        self._changed()

    async def close(self) -> None:
        await self.watcher.stop()
        await self.client.close()


def dns_target(entry: str) -> Optional[tuple[str, int]]:
    """(host, port) of a `dns:///host:port` (or `dns:host:port`) entry; None for a literal address."""
    if not entry.startswith("dns:"):
        return None
    rest = entry[4:].lstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"address {entry!r}: write a DNS name as dns:///host:port")
    return host.strip("[]"), int(port)


async def resolve(host: str, port: int) -> set[str]:
    """Every address `host` resolves to now, as gRPC targets ("10.0.0.1:50051", "[fd00::1]:50051")."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {f"[{ip}]:{p}" if family == socket.AF_INET6 else f"{ip}:{p}"
            for family, _, _, _, (ip, p, *_) in infos}
