"""Serving across ranks: rank 0 broadcasts each job, every rank runs its share, rank 0 gathers the pieces.

Jobs and events travel on the gloo control group (CPU tensors, pickled); the
model's own collectives run on the TP/CP groups. After every step rank 0 shares
which of the batch's jobs are dropped (cancelled, ended for a slow reader), so
every rank skips the same work at the same point and a dropped job's remaining
chunks are computed nowhere. Every collective has the
groups' timeout; idle rank 0 sends a heartbeat (the scheduler's idle tick) so
waiting ranks never time out while healthy and a dead rank is noticed within one.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from .engine import Engine
from .events import Event, JobDone, StageTime, Step
from .errors import Unavailable
from .parallel import ParallelContext
from .spec import Job

log = logging.getLogger("logitserve.distributed")

_JOB, _NOOP, _STOP = "job", "noop", "stop"
_END = object()


def _others_emit(jobs: list[Job], step: Step, ctx: ParallelContext) -> bool:
    """Whether ranks other than 0 produce pieces in this step; every rank reaches the same answer.

    Under TP alone, the outputs every TP rank holds alike come from rank 0; only
    full-logits slices come from each rank's vocab shard. Under CP, rows are spread; under PP the last stage
    holds the head.
    """
    return ctx.cp > 1 or ctx.pp > 1 or any(jobs[j].full_logits is not None for j in step.jobs)


def _share_dropped(dropped: list[bool], ctx: ParallelContext, skip: Optional[Callable[[int], bool]] = None,
                   nested: bool = False) -> bool:
    """Rank 0 adds what `skip` says now and sends the flags, and whether a batch runs nested before the next step;
    the other ranks receive them. `dropped` in place; returns `nested`."""
    flags = torch.tensor([bool(d or (skip is not None and skip(i))) for i, d in enumerate(dropped)] + [nested],
                         dtype=torch.uint8)                                                     # [jobs + 1]
    dist.broadcast(flags, src=0, group=ctx.control_group)
    dropped[:] = [bool(x) for x in flags[:-1].tolist()]
    return bool(flags[-1])


class RankLost(Unavailable):
    """A collective failed or timed out: some rank is gone, so is the service."""


class DistributedRunner:
    """Rank 0's side: `run_batch` is the Scheduler's batch runner, `heartbeat` its idle tick."""

    def __init__(self, engine: Engine, ctx: ParallelContext, on_fatal: Callable[[str], None] = lambda reason: None):
        assert ctx.is_root
        self._engine = engine
        self._ctx = ctx
        self._on_fatal = on_fatal
        self._failed: Optional[str] = None
        self._lock = threading.Lock()
        self.last_bubble: Optional[float] = None      # --pp: the last batch's bubble fraction

    @property
    def failed(self) -> Optional[str]:
        return self._failed

    def _collective(self, fn, *args, **kwargs):
        if self._failed:
            raise RankLost(f"the server lost a rank and is shutting down: {self._failed}")
        try:
            return fn(*args, **kwargs)
        except Exception as e:   # gloo/NCCL: connection reset, timeout, ...
            self._failed = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            log.error("a collective or a rank's step failed; the ranks are out of step: %s", self._failed)
            self._on_fatal(self._failed)
            raise RankLost(f"a rank was lost while serving: {self._failed}") from e

    def _broadcast(self, msg) -> None:
        self._collective(dist.broadcast_object_list, [msg], src=0, group=self._ctx.control_group)

    def _gather(self, events: list[Event]) -> list[Event]:
        out = [None] * self._ctx.config.world_size
        self._collective(dist.gather_object, events, out, dst=0, group=self._ctx.control_group)
        out[0] = events                  # rank 0's own, not their pickled round trip
        return [e for rank_events in out for e in rank_events]

    def run_batch(self, jobs: list[Job], skip: Callable[[int], bool] = lambda i: False,
                  between=None, short: bool = False) -> Iterator[Event]:
        """One broadcast for the batch; every rank's events as the ranks' steps are gathered.

        `skip` is read after every step and shared with the other ranks (_share_dropped), so all of them
        drop a cancelled job's remaining work at the same point. `between` (server.batch_runner) may nest a
        batch of small jobs at a step boundary: the same flags tell every rank (under --pp its activations travel
        on their own group, logitserve.pipeline).
        """
        with self._lock:
            yield from self._batch(jobs, skip, between, short)

    def _batch(self, jobs: list[Job], skip: Callable[[int], bool], between, short: bool = False) -> Iterator[Event]:
        dropped = [bool(skip(i)) for i in range(len(jobs))]
        self._broadcast((_JOB, (jobs, dropped, short)))
        steps = self._engine.batch_steps(jobs, lambda j: dropped[j], short=short)
        # A job's own error (every rank raises it alike) becomes its JobFailed and the ranks go on in step;
        # what escapes a step (a failed collective) leaves them out of step: fatal.
        try:
            while (step := self._collective(next, steps, _END)) is not _END:
                # The step's events are gathered before anything is yielded: a consumer leaving at any
                # yield below finds every rank past this step's gather and before its _share_dropped.
                others = _others_emit(jobs, step, self._ctx)
                events = self._gather(list(step.events)) if others else list(step.events)
                self._stage_times(events)
                yield from events
                yield from (JobDone(j) for j in step.done)     # after every rank's events of the step
                nested = between() if between is not None else None
                self._collective(_share_dropped, dropped, self._ctx, skip, nested is not None)
                if nested is not None:
                    self._nest(nested)
        except GeneratorExit:
            # The consumer left; the other ranks are mid-batch: drop every job and finish it in lockstep.
            self._collective(_share_dropped, dropped, self._ctx, lambda i: True)
            while (step := self._collective(next, steps, _END)) is not _END:
                if _others_emit(jobs, step, self._ctx):
                    self._gather(list(step.events))
                self._collective(_share_dropped, dropped, self._ctx, lambda i: True)
            raise

    def _nest(self, nested) -> None:
        """Run the scheduler's nested batch on every rank now (the ranks were told); if it ran none, release them."""
        ran = []

        def run(jobs: list[Job], skip: Callable[[int], bool], between=None, short: bool = False) -> Iterator[Event]:
            ran.append(True)
            return self._batch(jobs, skip, None)
        try:
            nested(run)
        finally:
            if not ran:
                self._broadcast((_NOOP, None))

    def _stage_times(self, events: list[Event]) -> None:
        """The stages' timings, which end a batch under PP: its bubble, logged."""
        from .pipeline import bubble_fraction

        times = [e for e in events if isinstance(e, StageTime)]
        if times:
            self.last_bubble = bubble_fraction(times)
            log.info("pipeline batch: bubble %.3f (stages busy %s s of %s s)", self.last_bubble,
                     "/".join(f"{t.busy_s:.3f}" for t in sorted(times, key=lambda t: t.stage)),
                     "/".join(f"{t.wall_s:.3f}" for t in sorted(times, key=lambda t: t.stage)))

    def heartbeat(self) -> None:
        with self._lock:
            self._broadcast((_NOOP, None))

    def stop(self) -> None:
        """Release the other ranks (they return from follow()); quiet if they are gone already."""
        if self._failed:
            return
        with self._lock:
            try:
                self._broadcast((_STOP, None))
            except RankLost:
                pass


def follow(engine: Engine, ctx: ParallelContext) -> None:
    """Ranks other than 0: run every broadcast job until told to stop; a failed collective raises."""
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=ctx.control_group)
        kind, payload = box[0]
        if kind == _STOP:
            return
        if kind == _JOB:
            _follow_batch(engine, ctx, *payload)


def _follow_batch(engine: Engine, ctx: ParallelContext, jobs: list[Job], dropped: list[bool], short: bool) -> None:
    """A rank's share of one batch, and of a batch nested between its steps when rank 0 says so."""
    for step in engine.batch_steps(jobs, lambda j: dropped[j], short=short):
        if _others_emit(jobs, step, ctx):
            dist.gather_object(list(step.events), None, dst=0, group=ctx.control_group)
        if _share_dropped(dropped, ctx):
            box = [None]
            dist.broadcast_object_list(box, src=0, group=ctx.control_group)
            kind, payload = box[0]
            if kind == _JOB:
                _follow_batch(engine, ctx, *payload)
