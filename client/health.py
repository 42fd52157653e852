"""grpc.health.v1 Watch on a channel, encoded by hand (the client needs no grpcio-health-checking); a wait for a
server to be ready that says what it waits for."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

import grpc

from logitserve.v1 import logitserve_pb2 as pb

# The service whose status the server sets (NOT_SERVING while loading and from the first moment of a drain).
SERVICE = pb.DESCRIPTOR.services_by_name["LogitServe"].full_name
_WATCH = "/grpc.health.v1.Health/Watch"
# HealthCheckResponse.ServingStatus (grpc/health/v1/health.proto)
SERVING, NOT_SERVING = 1, 2
STATUS_NAMES = {0: "UNKNOWN", SERVING: "SERVING", NOT_SERVING: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
UNREACHABLE = "UNREACHABLE"     # no Watch stream: the replica is down, restarting, or not yet listening
# A wait for readiness longer than this is said (a logging warning), then again every SAY_AGAIN_S.
SAY_AFTER_S, SAY_AGAIN_S = 1.0, 60.0

log = logging.getLogger("logitserve.client")


async def said_wait(wait, address: str, timeout_s: float):
    """The result of `wait` (a client's `wait_ready(timeout_s)` coroutine); when it takes longer than SAY_AFTER_S, a
    warning names the address and the bound, and another every SAY_AGAIN_S, so a wait is never silent."""
    task = asyncio.ensure_future(wait)
    t0 = time.monotonic()
    pause = SAY_AFTER_S
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=pause)
            if done:
                return task.result()
            log.warning("waiting for %s to answer (%.0f s of at most %g s so far): a server still starting or loading, "
                        "or nothing listening there", address, time.monotonic() - t0, timeout_s)
            pause = SAY_AGAIN_S
    finally:
        task.cancel()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_request(service: str) -> bytes:
    """HealthCheckRequest{service = 1}."""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_status(data: bytes) -> int:
    """HealthCheckResponse's status (field 1, a varint); fields it does not know are skipped."""
    i, status = 0, 0
    while i < len(data):
        tag, i = _read_varint(data, i)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = _read_varint(data, i)
            if field == 1:
                status = value
        elif wire == 2:
            size, i = _read_varint(data, i)
            i += size
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:
            raise ValueError(f"health response: wire type {wire} not expected")
    return status


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise ValueError("health response: truncated varint")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


class Watcher:
    """Keeps one Watch stream open on a replica's channel and reports each status as it changes (a name from
    STATUS_NAMES, or UNREACHABLE while no stream is open); reconnects with backoff up to `max_backoff_s`."""

    def __init__(self, channel: grpc.aio.Channel, metadata, on_status: Callable[[str], object],
                 max_backoff_s: float = 1.0):
        self._watch = channel.unary_stream(_WATCH, request_serializer=lambda s: encode_request(s),
                                           response_deserializer=decode_status)
        self._metadata, self._on_status, self._max_backoff = metadata, on_status, max_backoff_s
        self._call: Optional[grpc.aio.UnaryStreamCall] = None
        self._task: Optional[asyncio.Task] = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def restart(self) -> None:
        """Drop the stream and open a new one: its first message re-states the replica's status (after a
        request found the replica gone while the stream had not yet noticed)."""
        if self._call is not None:
            self._call.cancel()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        delay = 0.05
        while True:
            opened = time.monotonic()
            self._call = self._watch(SERVICE, metadata=self._metadata)
            try:
                async for status in self._call:
                    delay = 0.05
                    await self._report(STATUS_NAMES.get(status, "UNKNOWN"))
            except grpc.RpcError:
                pass
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise       # stop(); a restart() cancels only the call
            await self._report(UNREACHABLE)
            if time.monotonic() - opened > 1.0:
                delay = 0.05    # a stream that lived a while: reconnect at once, it may be a restart
            await asyncio.sleep(delay)
            delay = min(self._max_backoff, delay * 2)

    async def _report(self, status: str) -> None:
        result = self._on_status(status)
        if asyncio.iscoroutine(result):
            await result
