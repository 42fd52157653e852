"""Queues jobs from every client, runs them in token-budgeted batches on one compute thread, hands pieces back.

- Admission, before any work: a job is refused (RESOURCE_EXHAUSTED) when the queue would hold more
  than `max_queued_tokens` work tokens (tokens weighted by the head's extra work, logitserve.cost),
  or its client more than its share; or when the memory budget's books refuse it (server.held_bytes).
  Every refusal names the bound.
- Fairness: each client (server.admission.client_of) has its own queue; batches take the clients'
  oldest jobs in turn (server.client_queues); within a batch the cheapest jobs run first.
- Batching: the first job taken opens a batch; jobs arriving within `batch_delay_s` join while the
  batch stays under `max_batch_tokens`. A batch is one broadcast to the ranks and, in packed mode,
  one packed body (see logitserve.engine for the modes).
- Groups sent one sequence per request (server.grouping): a sequence continuing a prefix the batch
  holds counts only its own tokens, queued jobs continuing one join out of turn when they fit, and
  while more of a group keep arriving the batch stays open up to `share_wait_s` longer.
- The compute thread never waits on a client that holds anyone up: finished pieces go to the job's
  buffer (at most `max_buffered_bytes`, reserved in the memory budget). A job whose buffer is full
  waits for its reader only while no other job waits (at most `stall_timeout_s`, kept below the
  ranks' collective timeout); otherwise it ends with RESOURCE_EXHAUSTED naming the bound, its
  buffer freed, and everyone else goes on.
- Small jobs do not wait out a long batch: once a batch has run `interject_after_s`, at each of its steps the
  queued jobs of at most `interject_tokens` work tokens (up to that many in all) run as a batch of their own
  before its next step (server.batch_runner). A heavy job's head steps are cut to about the work
  of a plain one's (logitserve.cost.head_chunk_rows), so the wait is about one step. A job of a group
  arriving in parts is taken so only with all its queued mates, when they fit together; else it waits for a
  batch with its group, which computes the prefix once (ClientQueues.take_small); in grouped mode a shareable
  job waits `share_wait_s` after it arrived for more of its group first. While small jobs keep
  coming (one arrived, or ran between a batch's steps, in the last `short_steps_s`), a batch holding a larger
  job runs in short head steps (Engine.short_step_rows, --short-step-ms), so the step they wait for is short
  too; with none for that long, batches go back to full steps and their throughput.
- Cancellation: a cancelled or timed-out job is skipped if queued and stopped at its next piece if
  running; its pieces are dropped.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import AsyncIterator, Callable, Iterator, Optional

from logitserve.cost import Cost
from logitserve.errors import OverLimit, TooLarge
from logitserve.events import Event, JobDone, JobFailed, JobPiece, Piece, SharedTokens, StageTime
from logitserve.spec import Job

from .admission import UNKNOWN, Tally
from .batch_runner import BatchRun, Between, Nested, engine_batch_runner  # noqa: F401 (engine_batch_runner: re-export)
from .client_queues import ClientQueues
from .config import SchedulerConfig
from .grouping import GROUPED_S, Gathering, Shareable, close_time
from .held_bytes import HeldBytes
from .ticket import DONE, Failed, Gone, Ticket


class Scheduler:
    def __init__(self, run_batch: BatchRun, config: SchedulerConfig = SchedulerConfig(),
                 estimate: Optional[Callable[[Job], int]] = None, idle: Optional[Callable[[], None]] = None,
                 metrics=None, cost: Optional[Callable[[Job], Cost]] = None,
                 shares: Optional[Callable[[Job], tuple[Shareable, ...]]] = None):
        """`shares`: a job's sequences that may share a prefix (server.grouping.shareables); None: no sharing."""
        self._run_batch = run_batch
        self._shares = shares
        self._gathering: Optional[Gathering] = None   # the batch being gathered
        self._split_at = float("-inf")                # when a group was last seen coming in parts (grouped mode)
        self._metrics = metrics      # server.metrics.Metrics, or None
        self.config = config
        self._estimate = estimate
        self._cost = cost
        self._idle = idle
        self._queues = ClientQueues()
        self._cond = threading.Condition()
        self._work = Tally()         # work tokens waiting or running
        self._budget = HeldBytes(config.memory_budget_bytes, config.client_budget_bytes)   # bytes requests hold
        self._stopping = False
        self._depth = 0              # batches running: 2 while one runs nested between another's steps
        self._small_seen = float("-inf")   # when a small job last arrived or ran between a batch's steps
        self.batches_run = 0
        self._thread = threading.Thread(target=self._loop, name="logitserve-compute", daemon=True)
        self._thread.start()

    # -- event-loop side --------------------------------------------------------
    def cost(self, job: Job) -> Optional[Cost]:
        return self._cost(job) if self._cost is not None else None

    def _hold(self, cost: Optional[Cost], extra: int) -> int:
        """Bytes a request holds until it ends: its arrays (decoded and as received), its output buffer."""
        if cost is None:
            return extra
        return 2 * cost.input_bytes + min(cost.output_bytes, self.config.max_buffered_bytes) + extra

    def _drop_hold(self, client: str, nbytes: int) -> None:
        with self._cond:
            self._budget.remove(client, nbytes)

    def reserve(self, client: str, nbytes: int, what: str) -> None:
        """Reserve `nbytes` in the memory budget for work outside a job's buffer (tokenizing a text, an HTTP
        answer being built and sent); OverLimit naming the bound. `release` gives it back."""
        self._budget.check_outside(nbytes, what)
        with self._cond:
            self._budget.check(client, nbytes, 0)
            self._budget.add(client, nbytes)

    def release(self, client: str, nbytes: int) -> None:
        self._drop_hold(client, nbytes)

    @contextlib.contextmanager
    def holding(self, client: str, nbytes: int, what: str):
        """`reserve` for the length of a with block."""
        self.reserve(client, nbytes, what)
        try:
            yield
        finally:
            self.release(client, nbytes)

    def admit(self, job: Job, client: str = UNKNOWN, extra_hold: int = 0, cost: Optional[Cost] = None) -> Ticket:
        """Queue the job or raise OverLimit; `cost`: the job's, when the caller has it already."""
        c = self.config
        peak = self._estimate(job) if c.memory_budget_bytes is not None and self._estimate is not None else 0
        self._budget.check_peak(peak, max(len(s) for s in job.sequences))
        cost = cost or self.cost(job)
        shares = self._shares(job) if self._shares is not None else ()
        work = cost.work_tokens if cost is not None else job.num_tokens
        hold = self._hold(cost, extra_hold)
        self._budget.check_alone(hold, peak)
        share, flag = ((c.client_queued_tokens, "--max-queued-tokens-per-client")
                       if c.client_queued_tokens < c.max_queued_tokens else (c.max_queued_tokens, "--max-queued-tokens"))
        if work > share:        # over its client's share of an empty queue: refused every time, so permanent (413)
            raise TooLarge(f"queue: {work} tokens in this request > {flag} {share}, one client's share even of an "
                           f"empty queue (tokens weighted by filters and top-k work)")
        with self._cond:
            if self._work.total + work > c.max_queued_tokens:
                raise OverLimit(f"queue full: {self._work.total} tokens queued + {work} in this request > "
                                f"--max-queued-tokens {c.max_queued_tokens} (tokens weighted by filters and "
                                f"top-k work); retry later")
            mine = self._work.of(client)
            if mine + work > c.client_queued_tokens:
                raise OverLimit(f"queue: this client ({client}) has {mine} tokens queued + {work} in this request "
                                f"> --max-queued-tokens-per-client {c.client_queued_tokens}; retry later")
            self._budget.check(client, hold, peak)
            bound = c.max_buffered_bytes if c.overlap else 0
            ticket = Ticket(job, client, work, hold, asyncio.get_running_loop(), bound, shares)
            self._work.add(client, work)
            self._budget.add(client, hold)
            ticket.mate = bool(shares) and (self._queues.holds(shares) or (
                self._gathering is not None and self._gathering.holds(shares)))
            if ticket.mate:
                self._split_at = ticket.admitted
            if work <= c.interject_tokens and not (shares and ticket.admitted - self._split_at < GROUPED_S):
                self._small_seen = ticket.admitted   # small jobs are coming: batches beside them run short steps
                                                     # (a group's parts wait for their batch: take_small)
            self._queues.append(ticket)
            self._cond.notify()
        return ticket

    async def stream(self, job: Job, client: str = UNKNOWN, extra_hold: int = 0,
                     cost: Optional[Cost] = None) -> AsyncIterator[Piece | SharedTokens]:
        """Admit the job (or raise OverLimit) and yield its pieces as they are computed; `extra_hold`: bytes
        the caller holds for it beyond its buffer (KServe's dense answer)."""
        ticket = self.admit(job, client, extra_hold, cost)
        try:
            while True:
                item, nbytes = await ticket.take()
                if self.config.overlap:
                    ticket.release(nbytes)
                if isinstance(item, Failed):
                    raise item.error
                if item is DONE:
                    return
                yield item
                if not self.config.overlap:   # hand the next piece over only once this one has gone out
                    ticket.release(nbytes)
        finally:
            ticket.cancel()
            self._drop_if_queued(ticket)
            self._drop_hold(ticket.client, ticket.hold)

    def _drop_if_queued(self, ticket: Ticket) -> None:
        """A job given up before it ran leaves the queue now, freeing its tokens for others."""
        with self._cond:
            if self._queues.remove(ticket):     # else a batch took it: the batch accounts for it
                self._release_work([ticket])

    def _release_work(self, tickets: list[Ticket]) -> None:
        for t in tickets:
            self._work.remove(t.client, t.work)

    @property
    def busy(self) -> bool:
        """A batch is running or jobs are queued (read without the lock: a hint for bulk work to yield)."""
        return self._depth > 0 or bool(self._queues)

    def queue_length(self) -> int:
        """Jobs waiting for a batch."""
        with self._cond:
            return len(self._queues)

    def queued_tokens(self) -> int:
        with self._cond:
            return self._work.total

    def held_bytes(self) -> int:
        """Bytes reserved in the memory budget by requests in flight."""
        with self._cond:
            return self._budget.held

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def join(self, timeout: float) -> bool:
        """Wait for the compute thread to finish its batch after shutdown(); whether it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- compute thread -----------------------------------------------------------
    def _fill(self, batch: list[Ticket], tokens: int) -> int:
        """Add the jobs next in turn while they fit, then queued jobs continuing a prefix of the batch (they add
        their own tokens only); the batch's tokens after."""
        limit, g = self.config.max_batch_tokens, self._gathering
        q = self._queues
        while (nxt := q.peek()) is not None and tokens + (n := g.body_tokens(nxt.tokens, nxt.shares)) <= limit:
            tokens += n
            batch.append(q.pop())
            g.add(nxt)
        for mate in self._queues.mates(g.keys()):
            n = g.body_tokens(mate.tokens, mate.shares)
            if tokens + n <= limit:
                tokens += n
                self._queues.take_out_of_turn(mate)
                batch.append(mate)
                g.add(mate)
        return tokens

    def _next_batch(self) -> Optional[list[Ticket]]:
        c = self.config
        with self._cond:
            while not self._queues and not self._stopping:
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
            opened = time.monotonic()
            batch = [self._queues.pop()]
            self._gathering = g = Gathering()
            tokens = g.body_tokens(batch[0].tokens, batch[0].shares)
            g.add(batch[0])
            while True:
                tokens = self._fill(batch, tokens)
                grouped = opened - self._split_at < GROUPED_S
                left = close_time(opened, g.last(grouped), c.batch_delay_s, c.share_wait_s) - time.monotonic()
                nxt = self._queues.peek()
                if left <= 0 or tokens >= c.max_batch_tokens or (
                        nxt is not None and tokens + g.body_tokens(nxt.tokens, nxt.shares) > c.max_batch_tokens):
                    break
                self._cond.wait(timeout=left)
            self._gathering = None
        batch.sort(key=lambda t: t.work)   # cheapest first: packs and head chunks follow this order, so a small
        return batch                       # request sharing a batch with a large one is not computed after it

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._release_work(batch)

    def _between(self, started: float) -> Between:
        """The hook a batch's runner calls after each step: the queued small jobs to run now, or None."""
        c = self.config

        def between() -> Optional[Nested]:
            if time.monotonic() - started < c.interject_after_s or not self._queues:
                return None
            now = time.monotonic()
            held_after = now - c.share_wait_s if now - self._split_at < GROUPED_S else None
            with self._cond:        # grouped mode: a shareable job waits out the share window for its mates
                small = self._queues.take_small(c.interject_tokens, held_after)
            if not small:
                return None
            self._small_seen = max(self._small_seen, time.monotonic())   # admit() writes it too, under the lock

            def nested(run_batch: BatchRun) -> None:
                try:
                    small.sort(key=lambda t: t.work)
                    self._run(small, run_batch)
                finally:
                    with self._cond:
                        self._release_work(small)
            return nested
        return between

    def _short(self, batch: list[Ticket], live: list[bool], now: float) -> bool:
        """Whether this batch runs in short head steps: small jobs arrived or ran between a batch's steps lately, and
        it holds a job larger than those (a batch of small jobs alone is over soon anyway)."""
        c = self.config
        return now - self._small_seen < c.short_steps_s and any(
            ok and t.work > c.interject_tokens for t, ok in zip(batch, live))

    def _events(self, batch: list[Ticket], live: list[bool], started: float,
                nested_in: Optional[BatchRun]) -> Iterator[Event]:
        """The batch's events from its runner: nested in another's steps, with `between` and short steps, or plain."""
        jobs, skip = [t.job for t in batch], lambda i: not live[i] or batch[i].cancelled.is_set()
        if nested_in is not None:
            return nested_in(jobs, skip)
        if self.config.interject_after_s > 0:
            return self._run_batch(jobs, skip, self._between(started), short=self._short(batch, live, started))
        return self._run_batch(jobs, skip)

    def _run(self, batch: list[Ticket], nested_in: Optional[BatchRun] = None) -> None:
        """Run a batch; `nested_in`: the runner of a batch nested between another's steps (it always starts, so
        ranks that were told of it run it in step, and it gets no nested batch of its own)."""
        live = [not t.cancelled.is_set() for t in batch]
        if not any(live) and nested_in is None:
            return
        self.batches_run += 1
        started = time.monotonic()
        waits = [started - t.admitted for t, ok in zip(batch, live) if ok]
        if self._metrics is not None:
            self._metrics.batch_started(waits, sum(t.tokens for t, ok in zip(batch, live) if ok))
        events: Iterator[Event] = iter(())
        self._depth += 1
        try:
            events = self._events(batch, live, started, nested_in)
            for event in events:
                if isinstance(event, StageTime):
                    continue
                if not live[event.job]:
                    if not any(live):    # every job gone (cancelled, too slow, shutting down): stop computing
                        break
                    continue
                self._hand(batch, live, event.job, _item(event))
        except BaseException as e:   # the whole batch failed (a lost rank, a runner that raised): every job hears why
            for i in range(len(batch)):
                if live[i]:
                    self._hand(batch, live, i, Failed(e))
        finally:
            if hasattr(events, "close"):   # a generator's: its work stops here (a plain iterator has none)
                events.close()
            self._depth -= 1
            if self._metrics is not None:
                self._metrics.batch_done(waits, time.monotonic() - started)
        for i in range(len(batch)):
            if live[i]:
                self._hand(batch, live, i, DONE)

    def _hand(self, batch: list[Ticket], live: list[bool], i: int, item) -> None:
        """One item to job i's stream; a job whose stream is gone, or that failed, takes no more."""
        try:
            batch[i].put(item, self._may_wait(batch, live, i), self.config.stall_timeout_s)
        except Gone:
            live[i] = False
            return
        if isinstance(item, Failed) or item is DONE:
            live[i] = False

    def _may_wait(self, batch: list[Ticket], live: list[bool], i: int) -> Callable[[], bool]:
        """Whether job i may hold the compute thread: no other job of this batch, of the queue or of a batch this
        one is nested in waits."""
        if not self.config.overlap:    # the measuring mode waits on every reader
            return lambda: True
        return lambda: not self._queues and self._depth == 1 and not any(ok for j, ok in enumerate(live) if j != i)


def _item(event: Event):
    """What a job's stream takes for an event of the job: its piece, its shared tokens, or its failure."""
    if isinstance(event, JobPiece):
        return event.piece
    if isinstance(event, JobFailed):   # that job's own error: it alone fails
        return Failed(event.error)
    if isinstance(event, JobDone):     # its outputs are complete: its stream ends before the rest of the batch
        return DONE
    return event
