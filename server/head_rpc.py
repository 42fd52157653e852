"""The Head RPC: the lm_head in bands, under server-wide and per-client download slots, each write under a stall bound.

A download holds one server-wide slot (`--max-head-downloads`) and one of its client's
(`--max-head-downloads-per-client`, by default half the server-wide count, at least 1) while it
runs; more are refused RESOURCE_EXHAUSTED naming the flag, which the client library waits out.
Every message is written with a deadline (`--head-stall-s`): a reader that takes no message for
that long loses its server-wide slot at once and its download ends RESOURCE_EXHAUSTED. Its
client's slot stays held until the call is really over (the client reads the status or goes
away), so one client cannot pile up unread downloads, each holding a band in the transport.
A download the client cancels (or the server's stop ends) logs one line, never a traceback.
`info_only` requests send one small message and take no slot. Every call is first admitted as a
Forward request is (server/requests.py: refused UNAVAILABLE while draining, counted among its
client's requests in flight, ended with the others when the grace period is over).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import grpc

from logitserve.errors import LogitServeError, NotSupported, OverLimit
from logitserve.v1 import logitserve_pb2 as pb

from . import codec
from .status import to_status

log = logging.getLogger("logitserve.server")


@dataclass(frozen=True)
class HeadLimits:
    """Head downloads: how many at once, server-wide and per client, and when a stalled reader is cut."""

    max_downloads: int = 2                        # in flight server-wide (--max-head-downloads)
    max_downloads_per_client: Optional[int] = None   # one client's (--max-head-downloads-per-client); None: half
    stall_s: float = 10.0                         # a message not taken for this long cuts the download (--head-stall-s)

    def __post_init__(self):
        if self.max_downloads < 1 or not self.stall_s > 0:
            raise ValueError(f"--max-head-downloads {self.max_downloads} must be >= 1 and --head-stall-s "
                             f"{self.stall_s:g} > 0")
        per = self.max_downloads_per_client
        if per is not None and not 1 <= per <= self.max_downloads:
            raise ValueError(f"--max-head-downloads-per-client {per} must be in [1, --max-head-downloads "
                             f"{self.max_downloads}]")

    @property
    def per_client(self) -> int:
        """The per-client share in effect: as given, else half the server-wide count (at least 1)."""
        if self.max_downloads_per_client is not None:
            return self.max_downloads_per_client
        return max(1, self.max_downloads // 2)

    def describe(self) -> str:
        return (f"Head downloads: {self.max_downloads} at once server-wide, {self.per_client} per client; a reader "
                f"that takes no message for {self.stall_s:g} s is cut (--head-stall-s)")


class HeadSlots:
    """Downloads holding a server-wide slot, and downloads per client (held until each call is over)."""

    def __init__(self, limits: HeadLimits):
        self.limits = limits
        self.running = 0                        # downloads holding a server-wide slot
        self._held: dict[str, int] = {}         # client -> its downloads not over yet (running or cut)

    def held(self, client: str) -> int:
        return self._held.get(client, 0)

    def take(self, client: str) -> Optional[str]:
        """None when a slot was taken for `client`, else the refusal (the event loop's thread only: no lock)."""
        lim = self.limits
        n = self.held(client)
        if n >= lim.per_client:
            return (f"Head: this client ({client}) has {n} head download{'s' * (n != 1)} in flight, the server's "
                    f"--max-head-downloads-per-client is {lim.per_client}; retry when one ends")
        if self.running >= lim.max_downloads:
            return (f"Head: {self.running} head downloads are in flight, the server's --max-head-downloads is "
                    f"{lim.max_downloads}; retry when one ends (a stalled one is cut after --head-stall-s "
                    f"{lim.stall_s:g} s)")
        self.running += 1
        self._held[client] = n + 1
        return None

    def free_running(self) -> None:
        self.running -= 1

    def free_client(self, client: str) -> None:
        n = self.held(client) - 1
        if n > 0:
            self._held[client] = n
        else:
            self._held.pop(client, None)


class _Stalled(Exception):
    """The reader took no message within --head-stall-s."""


class _Gone(Exception):
    """A write failed: the client cancelled or its connection is gone."""


class HeadRpc:
    """Serves Head calls for one HeadSource (None: a reward model, refused FAILED_PRECONDITION)."""

    def __init__(self, head, content_hash: str, max_message_bytes: int, limits: HeadLimits = HeadLimits()):
        self._head = head                       # logitserve.head_export.HeadSource, or None
        self._content_hash = content_hash
        self._max_message_bytes = max_message_bytes
        self.slots = HeadSlots(limits)
        self._hash_lock = asyncio.Lock()        # the first hash reads the whole head: one thread does it, once

    @property
    def limits(self) -> HeadLimits:
        return self.slots.limits

    async def serve(self, request: pb.HeadRequest, context, client: str, admitted) -> None:
        """One Head call: refused with its status, or its messages written one by one under the stall bound.
        `admitted`: the request pipeline's admission (Pipeline.admitted: draining, requests in flight per
        client), held for the whole call as a Forward request's."""
        try:
            if self._head is None:
                raise NotSupported("Head", "this server holds a reward model: it has no lm_head to send")
            with admitted(client):
                if request.info_only:
                    await self._send_info(context)
                else:
                    await self._download(context, client)
        except LogitServeError as e:     # refused before any message: its status, in one place
            code, message = to_status(e)
            context.set_code(code)
            context.set_details(message)

    async def _send_info(self, context) -> None:
        """`info_only`: one small message, no download slot."""
        try:
            await self._write(context, await self._info())
        except (_Stalled, _Gone):
            raise asyncio.CancelledError() from None     # one small message never taken: nothing to log

    async def _download(self, context, client: str) -> None:
        """The whole head under a server-wide and a per-client slot (OverLimit when none is free)."""
        refusal = self.slots.take(client)
        if refusal is not None:
            raise OverLimit(refusal)
        sent, running = 0, True
        try:
            async with contextlib.aclosing(self._messages()) as messages:
                async for msg in messages:
                    await self._write(context, msg)
                    sent += 1
        except _Stalled:
            self.slots.free_running()          # at once: the slot is for readers
            running = False
            await self._cut(context, client, sent)
        except (asyncio.CancelledError, _Gone):
            log.info("Head download for %s ended early after %d messages: the client cancelled or disconnected, "
                     "or the server is stopping", client, sent)
            raise asyncio.CancelledError() from None   # grpc ends a cancelled call quietly; no status to send
        finally:
            if running:
                self.slots.free_running()
            self.slots.free_client(client)

    async def _cut(self, context, client: str, sent: int) -> None:
        """A stalled reader's download ends RESOURCE_EXHAUSTED; its client's slot stays held until the status
        is taken (the call is over): one client cannot pile up unread downloads."""
        message = (f"Head: the reader took no message for {self.limits.stall_s:g} s (the server's "
                   f"--head-stall-s) after {sent} messages; download cut, read as messages arrive")
        log.warning("Head download for %s cut: no message taken for %g s (--head-stall-s) after %d messages",
                    client, self.limits.stall_s, sent)
        try:     # the status waits behind the queued band: it ends the call once the client reads or leaves
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        except grpc.aio.AbortError:
            raise
        except (asyncio.CancelledError, Exception):   # noqa: BLE001 (the client left meanwhile: said already)
            raise asyncio.CancelledError() from None

    async def _info(self) -> pb.HeadResponse:
        head = self._head
        async with self._hash_lock:
            digest = await asyncio.to_thread(head.head_hash)     # once per server; reads the whole head
        return codec.encode_head_info(head.meta, self._content_hash, digest)

    async def _messages(self):
        """HeadInfo, the weight's row bands (each under the message limit), the bias's, then the chunk count."""
        head = self._head
        meta = head.meta
        yield await self._info()
        n = 0
        band = max(1, (self._max_message_bytes - codec.HEADER_ROOM) // (meta.hidden_size * meta.dtype.itemsize))
        for a in range(0, meta.vocab_size, band):
            rows = await asyncio.to_thread(head.rows, a, min(a + band, meta.vocab_size))   # [band, H]
            yield codec.encode_head_chunk("weight", a, rows)
            n += 1
        bias = head.bias()
        if bias is not None:
            per = max(1, (self._max_message_bytes - codec.HEADER_ROOM) // bias.element_size())
            for a in range(0, len(bias), per):
                yield codec.encode_head_chunk("bias", a, bias[a : a + per])
                n += 1
        yield pb.HeadResponse(num_chunks=n)

    async def _write(self, context, msg) -> None:
        """One message under the stall bound; _Stalled past it, _Gone when the call is over on the client's side."""
        try:
            await asyncio.wait_for(context.write(msg), self.limits.stall_s)
        except TimeoutError:
            raise _Stalled() from None
        except asyncio.CancelledError:
            raise
        except Exception as e:   # noqa: BLE001 (grpc's ExecuteBatchError and kin: the call is gone)
            raise _Gone(str(e)) from None
