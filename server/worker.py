"""Runs jobs on one compute thread and streams their pieces back to the event loop, with backpressure."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Iterator

from logitserve.engine import Piece
from logitserve.spec import Job

_DONE = object()


class _Cancelled(Exception):
    pass


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Worker:
    """FIFO of jobs on a single thread (the model is not re-entrant); each job's pieces flow back as produced.

    A job may hold at most `max_pending` pieces not yet taken by its consumer, so a
    slow client bounds the server's memory instead of growing it. A consumer that
    goes away (cancelled, deadline) stops its job at the next piece.
    """

    def __init__(self, run: Callable[[Job], Iterator[Piece]], max_pending: int = 2):
        self._run = run
        self._max_pending = max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logitserve-compute")

    async def stream(self, job: Job) -> AsyncIterator[Piece]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        credits = threading.Semaphore(self._max_pending)
        cancelled = threading.Event()

        def send(item) -> None:
            while not credits.acquire(timeout=0.2):
                if cancelled.is_set():
                    raise _Cancelled()
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError as e:  # the event loop is gone: the server is stopping
                raise _Cancelled() from e

        def produce() -> None:
            if cancelled.is_set():
                return
            try:
                for piece in self._run(job):
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

        loop.run_in_executor(self._executor, produce)
        try:
            while True:
                item = await queue.get()
                credits.release()
                if item is _DONE:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                yield item
        finally:
            cancelled.set()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
