"""Queues jobs from every stream, runs them in token-budgeted batches on one compute thread, streams pieces back.

- Admission: a job is refused (RESOURCE_EXHAUSTED) when the queue would hold more than
  `max_queued_tokens`, or when its estimated peak memory is over `memory_budget_bytes`.
- Batching: the first queued job opens a batch; jobs arriving within `batch_delay_s`
  join while the batch stays under `max_batch_tokens`. A batch is one broadcast to the
  ranks and, in packed mode, one packed body (see logitserve.engine for the modes).
- Backpressure: a job holds at most `max_pending` pieces not yet taken by its stream; a
  client that reads nothing for `stall_timeout_s` loses the request, not the server.
- Cancellation: a cancelled or timed-out job is skipped if queued and stopped at its next
  piece if running; its pieces are dropped.
- Overlap: with `overlap`, the compute thread goes on as soon as a piece is handed over,
  so serializing and sending it runs beside the next chunk's compute.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator, Optional

from logitserve.engine import Piece, SharedTokens
from logitserve.errors import OverLimit
from logitserve.spec import Job

# (jobs, skip) -> (job index, Piece, or the exception that ends that job alone)
BatchRun = Callable[[list, Callable[[int], bool]], Iterator[tuple[int, object]]]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 16384        # tokens per batch (--max-batch-tokens)
    batch_delay_s: float = 0.002         # wait this long after the first job for others to join
    max_queued_tokens: int = 1 << 20     # tokens waiting or running (--max-queued-tokens)
    memory_budget_bytes: Optional[int] = None   # refuse jobs whose peak estimate is over this
    max_pending: int = 2                 # pieces a job may have computed but not yet handed to gRPC
    stall_timeout_s: float = 60.0        # a stream that takes no piece for this long loses its request
    overlap: bool = True                 # compute the next chunk while the last one is being sent
    idle_s: float = 2.0                  # with an idle callback: call it after this long without work

    def __post_init__(self):
        if self.max_batch_tokens < 1 or self.max_queued_tokens < 1 or self.max_pending < 1:
            raise ValueError(f"max_batch_tokens, max_queued_tokens and max_pending must be >= 1: {self}")


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


_DONE = object()


class _Gone(Exception):
    """The job's consumer is gone (cancelled, timed out, stalled)."""


class _Ticket:
    """One job's place in the queue and its channel back to the event loop."""

    def __init__(self, job: Job, loop: asyncio.AbstractEventLoop, max_pending: int, overlap: bool):
        self.job = job
        self.tokens = job.num_tokens
        self.loop = loop
        self.results: asyncio.Queue = asyncio.Queue()
        self.credits = threading.Semaphore(max_pending if overlap else 1)
        self.cancelled = threading.Event()
        self.admitted = time.monotonic()

    def cancel(self) -> None:
        self.cancelled.set()
        self.credits.release()   # wake a sender blocked on credits now, not at its next poll

    def send(self, item, stall_timeout_s: float) -> None:
        deadline = time.monotonic() + stall_timeout_s
        while not self.credits.acquire(timeout=0.1):
            if self.cancelled.is_set():
                raise _Gone()
            if time.monotonic() > deadline:
                self.cancelled.set()
                self.loop.call_soon_threadsafe(self.results.put_nowait, _Failed(OverLimit(
                    f"the stream took no result for stall_timeout_s={stall_timeout_s:g}; request dropped")))
                raise _Gone()
        if self.cancelled.is_set():   # woken by cancel(), not by a consumer
            raise _Gone()
        try:
            self.loop.call_soon_threadsafe(self.results.put_nowait, item)
        except RuntimeError as e:   # the event loop is gone: the server is stopping
            raise _Gone() from e


class Scheduler:
    def __init__(self, run_batch: BatchRun, config: SchedulerConfig = SchedulerConfig(),
                 estimate: Optional[Callable[[Job], int]] = None, idle: Optional[Callable[[], None]] = None,
                 metrics=None):
        self._run_batch = run_batch
        self._metrics = metrics      # server.metrics.Metrics, or None
        self.config = config
        self._estimate = estimate
        self._idle = idle
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._cond = threading.Condition()
        self._queued_tokens = 0      # waiting or running
        self._stopping = False
        self.batches_run = 0
        self._thread = threading.Thread(target=self._loop, name="logitserve-compute", daemon=True)
        self._thread.start()

    # -- event-loop side --------------------------------------------------------
    def admit(self, job: Job) -> _Ticket:
        c = self.config
        if c.memory_budget_bytes is not None and self._estimate is not None:
            need = self._estimate(job)
            if need > c.memory_budget_bytes:
                raise OverLimit(f"request needs ~{need / 2**20:.0f} MiB at peak (longest sequence "
                                f"{max(len(s) for s in job.sequences)} tokens), over --memory-budget "
                                f"{c.memory_budget_bytes / 2**20:.0f} MiB")
        with self._cond:
            if self._queued_tokens + job.num_tokens > c.max_queued_tokens:
                raise OverLimit(f"queue full: {self._queued_tokens} tokens queued + {job.num_tokens} in this "
                                f"request > --max-queued-tokens {c.max_queued_tokens}; retry later")
            ticket = _Ticket(job, asyncio.get_running_loop(), c.max_pending, c.overlap)
            self._queued_tokens += ticket.tokens
            self._queue.append(ticket)
            self._cond.notify()
        return ticket

    async def stream(self, job: Job) -> AsyncIterator[Piece]:
        """Admit the job (or raise OverLimit) and yield its pieces as they are computed."""
        ticket = self.admit(job)
        try:
            while True:
                item = await ticket.results.get()
                if isinstance(item, _Failed):
                    raise item.error
                if item is _DONE:
                    return
                if self.config.overlap:
                    ticket.credits.release()
                    yield item
                else:   # hand the next piece over only once this one has gone out
                    yield item
                    ticket.credits.release()
        finally:
            ticket.cancel()
            self._drop_if_queued(ticket)

    def _drop_if_queued(self, ticket: _Ticket) -> None:
        """A job given up before it ran leaves the queue now, freeing its tokens for others."""
        with self._cond:
            try:
                self._queue.remove(ticket)
            except ValueError:   # already taken into a batch: the batch accounts for it
                return
            self._queued_tokens -= ticket.tokens

    def queue_length(self) -> int:
        """Jobs waiting for a batch."""
        with self._cond:
            return len(self._queue)

    def queued_tokens(self) -> int:
        with self._cond:
            return self._queued_tokens

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        """Wait for the compute thread to finish its batch after shutdown(); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- compute thread -----------------------------------------------------------
    def _next_batch(self) -> Optional[list[_Ticket]]:
        c = self.config
        with self._cond:
            while not self._queue and not self._stopping:
                if not self._cond.wait(timeout=c.idle_s if self._idle else None) and self._idle:
                    self._cond.release()
                    try:
                        self._idle()
                    except Exception:   # the runner records it; the next job gets the status
                        pass
                    finally:
                        self._cond.acquire()
            if self._stopping:
                return None
            batch = [self._queue.popleft()]
            tokens = batch[0].tokens
            deadline = time.monotonic() + c.batch_delay_s
            while True:
                while self._queue and tokens + self._queue[0].tokens <= c.max_batch_tokens:
                    tokens += self._queue[0].tokens
                    batch.append(self._queue.popleft())
                left = deadline - time.monotonic()
                if left <= 0 or tokens >= c.max_batch_tokens or (self._queue and tokens + self._queue[0].tokens > c.max_batch_tokens):
                    break
                self._cond.wait(timeout=left)
        return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._queued_tokens -= sum(t.tokens for t in batch)

    def _run(self, batch: list[_Ticket]) -> None:
        live = [not t.cancelled.is_set() for t in batch]
        if not any(live):
            return
        self.batches_run += 1
        stall = self.config.stall_timeout_s
        started = time.monotonic()
        waits = [started - t.admitted for t, ok in zip(batch, live) if ok]
        if self._metrics is not None:
            self._metrics.batch_started(waits, sum(t.tokens for t, ok in zip(batch, live) if ok))
        pieces = self._run_batch([t.job for t in batch], lambda i: not live[i] or batch[i].cancelled.is_set())
        try:
            for i, item in pieces:
                if not live[i]:
                    if not any(live):    # every job gone (cancelled, stalled, shutting down): stop computing
                        break
                    continue
                if isinstance(item, BaseException):   # that job's own error: it alone fails
                    item = _Failed(item)
                try:
                    batch[i].send(item, stall)
                except _Gone:
                    live[i] = False
                    continue
                if isinstance(item, _Failed):
                    live[i] = False
        except BaseException as e:   # the whole batch failed (a lost rank): every job hears why
            for i, t in enumerate(batch):
                if live[i]:
                    live[i] = False
                    try:
                        t.send(_Failed(e), stall)
                    except _Gone:
                        pass
        finally:
            pieces.close()
            if self._metrics is not None:
                self._metrics.batch_done(waits, time.monotonic() - started)
        for i, t in enumerate(batch):
            if live[i]:
                try:
                    t.send(_DONE, stall)
                except _Gone:
                    pass


def engine_batch_runner(batch_steps) -> BatchRun:
    """Run a batch through an Engine's `batch_steps` in this process; a failing job fails alone."""
    def run(jobs: list, skip: Callable[[int], bool]) -> Iterator[tuple[int, object]]:
        steps = batch_steps(jobs, skip)
        try:
            for step in steps:
                yield from step.errors
                yield from ((j, SharedTokens(n)) for j, n in step.shared)
                yield from step.pieces
        finally:
            steps.close()
    return run
