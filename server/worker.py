"""Runs jobs on one compute thread and streams their pieces back to the event loop, with backpressure."""
from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator, Callable, Iterator, Optional

from logitserve.engine import Piece
from logitserve.spec import Job

_DONE = object()


class _Cancelled(Exception):
    pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Worker:
    """FIFO of jobs on a single thread (the model is not re-entrant and ranks must see one order).

    A job may hold at most `max_pending` pieces not yet taken by its consumer, so a
    slow client bounds the server's memory instead of growing it. A consumer that
    goes away (cancelled, deadline) stops its job at the next piece. With no job for
    `idle_s`, the thread calls `idle()` (the distributed heartbeat).
    """

    def __init__(self, run: Callable[[Job], Iterator[Piece]], max_pending: int = 2,
                 idle: Optional[Callable[[], None]] = None, idle_s: float = 2.0):
        self._run = run
        self._max_pending = max_pending
        self._idle = idle
        self._idle_s = idle_s
        self._tasks: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="logitserve-compute", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                task = self._tasks.get(timeout=self._idle_s if self._idle else None)
            except queue.Empty:
                try:
                    self._idle()
                except Exception:   # reported by the runner; the next job gets its status
                    pass
                continue
            if task is None:
                return
            task()

    async def stream(self, job: Job) -> AsyncIterator[Piece]:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()
        credits = threading.Semaphore(self._max_pending)
        cancelled = threading.Event()

        def send(item) -> None:
            while not credits.acquire(timeout=0.2):
                if cancelled.is_set():
                    raise _Cancelled()
            try:
                loop.call_soon_threadsafe(results.put_nowait, item)
            except RuntimeError as e:  # the event loop is gone: the server is stopping
                raise _Cancelled() from e

        def produce() -> None:
            if cancelled.is_set():
                return
            pieces = self._run(job)
            try:
                for piece in pieces:
                    if cancelled.is_set():
                        return
                    send(piece)
                send(_DONE)
            except _Cancelled:
                return
            except BaseException as e:  # handed to the consumer, which maps it to a status
                try:
                    send(_Failed(e))
                except _Cancelled:
                    pass
            finally:
                pieces.close()   # a job left early still finishes its collectives

        self._tasks.put(produce)
        try:
            while True:
                item = await results.get()
                credits.release()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            cancelled.set()

    def shutdown(self) -> None:
        self._tasks.put(None)
