"""One request's place in the scheduler: its queue entry and its byte-bounded buffer of computed pieces."""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable

from logitserve.errors import OverLimit
from logitserve.events import Piece
from logitserve.spec import Job

_MiB = 2 ** 20


@dataclass(frozen=True)
class Failed:
    """Ends a job's stream with its error: the job's own, the batch's (a lost rank), or its buffer's bound."""

    error: BaseException


DONE = object()   # ends a job's stream: every piece of it was handed over


class Gone(Exception):
    """The job's consumer is gone (cancelled, timed out, too slow)."""


def _nbytes(item) -> int:
    return item.tensor.numel() * item.tensor.element_size() if isinstance(item, Piece) else 0


class Ticket:
    """One job's place in the queue and its byte-bounded buffer back to the event loop."""

    def __init__(self, job: Job, client: str, work: int, hold: int, loop: asyncio.AbstractEventLoop, bound: int,
                 shares: tuple = ()):
        self.job, self.client = job, client
        self.shares = shares             # its sequences that may share a prefix (server.grouping.Shareable)
        self.mate = False                # admitted while a job with one of its prefixes was queued or being batched
        self.tokens = job.num_tokens     # what a batch holds (max_batch_tokens)
        self.work = work                 # what the queue counts (max_queued_tokens)
        self.hold = hold                 # bytes reserved in the memory budget until the request ends
        self.loop = loop
        self.bound = bound
        self.buffered = 0                # bytes handed over and not yet taken (or, without overlap, sent)
        self.ready = asyncio.Event()
        self.cancelled = threading.Event()
        self.admitted = time.monotonic()
        self._items: collections.deque = collections.deque()   # (item, nbytes)
        self._cond = threading.Condition()

    def cancel(self) -> None:
        with self._cond:
            self.cancelled.set()
            self._items.clear()
            self.buffered = 0
            self._cond.notify_all()

    def _full(self, nbytes: int) -> bool:
        return self.buffered > 0 and self.buffered + nbytes > self.bound

    def _fail(self, message: str) -> None:
        """End the request now: its buffer is freed and the reader finds the error first."""
        self.cancelled.set()
        self._items.clear()
        self.buffered = 0
        self._items.append((Failed(OverLimit(message)), 0))

    def put(self, item, may_wait: Callable[[], bool], stall_timeout_s: float) -> None:
        """Hand an item to the stream (compute thread). With the buffer full, wait for the reader only while
        `may_wait()` (no one else waits), at most `stall_timeout_s`; else end the request. Gone: it is over."""
        nbytes = _nbytes(item)
        deadline = time.monotonic() + stall_timeout_s
        with self._cond:
            while self._full(nbytes) and not self.cancelled.is_set():
                if not may_wait():
                    self._fail(f"the stream read too slowly: {self.buffered / _MiB:.1f} MiB of its results "
                               f"waited unread (the server's --max-buffered-bytes is {self.bound / _MiB:.0f} "
                               f"MiB per request) while other requests waited; read as results arrive, ask "
                               f"for less per request, or raise --max-buffered-bytes")
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self._fail(f"the stream took no result for stall_timeout_s={stall_timeout_s:g} "
                               f"(--stall-timeout) with {self.buffered / _MiB:.1f} MiB waiting; request dropped")
                    break
                self._cond.wait(min(left, 0.05))
            self._enqueue(item, nbytes)   # nothing once the request is over (cancelled or failed just now)
            gone = self.cancelled.is_set()
        self._wake()
        if gone:
            raise Gone()

    def _enqueue(self, item, nbytes: int) -> None:
        if not self.cancelled.is_set():
            self._items.append((item, nbytes))
            self.buffered += nbytes

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self.ready.set)
        except RuntimeError as e:   # the event loop is gone: the server is stopping
            raise Gone() from e

    async def take(self) -> tuple[object, int]:
        """The next item and its bytes (event loop); release() the bytes once they no longer count."""
        while True:
            with self._cond:
                if self._items:
                    return self._items.popleft()
                self.ready.clear()    # a put after this schedules ready.set() after it: no wake-up is lost
            await self.ready.wait()

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.buffered = max(0, self.buffered - nbytes)
            self._cond.notify_all()
