"""A batch in progress: which of its jobs were skipped or failed, and the one place where a failure becomes its job's.

Work several jobs share (a packed body, a head chunk's matmul) is tried together; when it
fails with an error that can stay with one job, the caller redoes it job by job (`shared`),
and a job whose own work fails gets one `JobFailed` and is dropped (`attempt`, `guard`). A
failed collective, or across ranks an error that may be one rank's alone, is never isolated.
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, TypeVar

import torch

from .collectives import CollectiveFailed
from .errors import OverLimit
from .events import Event, JobFailed, Step
from .spec import Job

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
T = TypeVar("T")


def _out_of_memory(e: Exception) -> Optional[OverLimit]:
    """A device or host allocation that failed for this job alone (its shared batch was already redone per job):
    the request's RESOURCE_EXHAUSTED, with the allocator's cache returned; None for any other error."""
    host = isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))
    if not (isinstance(e, _OOM) or host):
        return None
    if isinstance(e, _OOM) and torch.cuda.is_available():
        torch.cuda.empty_cache()
    where = "host" if host else "device"
    return OverLimit(f"memory: the {where} ran out of memory computing this request alone ({str(e)[:160]}); send "
                     f"fewer or shorter sequences per request (a --memory-budget refuses such requests up front)")


class BatchRun:
    """A batch in progress: its jobs, which were skipped or failed, and whether failures stay with their job.

    `reports`: whether this rank emits the events every rank computes alike (a job's failure, shared tokens):
    one rank does, so a gathered step holds each once. `step_rows`: rows of a plain head step in this batch
    (Engine.step_rows, or its short_step_rows; a heavier job's steps take fewer, logitserve.cost).
    """

    def __init__(self, jobs: list[Job], skip: Callable[[int], bool], isolate: bool, across_ranks: bool = False,
                 reports: bool = True, step_rows: int = 512):
        self.jobs = jobs
        self.step_rows = step_rows
        self.skip = skip
        self.isolate = isolate
        self.across_ranks = across_ranks
        self.reports = reports
        self.failed: set[int] = set()

    def live(self, j: int) -> bool:
        return j not in self.failed and not self.skip(j)

    def fail(self, j: int, e: Exception) -> tuple[Event, ...]:
        """Job j's own failure: it is dropped from the batch; its event (from the reporting rank)."""
        self.reraise_unless_isolated(e)
        self.failed.add(j)
        return (JobFailed(j, _out_of_memory(e) or e),) if self.reports else ()

    def guard(self, j: int, steps: Iterator[Step]) -> Iterator[Step]:
        """The steps of work that is job j's alone, until it is skipped; an exception becomes one Step."""
        try:
            for step in steps:
                yield step
                if not self.live(j):
                    return
        except Exception as e:
            yield Step((j,), self.fail(j, e))

    def attempt(self, j: int, work: Callable[[], tuple[Event, ...]]) -> tuple[Event, ...]:
        """The events of work that is job j's alone, or its failure."""
        try:
            return work()
        except Exception as e:
            return self.fail(j, e)

    def shared(self, work: Callable[[], T]) -> Optional[T]:
        """Work several jobs share; None when it failed with an error that can stay with a job (then the caller
        redoes the work job by job, so that the job that caused it fails alone)."""
        try:
            return work()
        except Exception as e:
            self.reraise_unless_isolated(e)
            return None

    def reraise_unless_isolated(self, e: Exception) -> None:
        """A job's own error stays with the job (when isolating); a failed collective never does. Across ranks only
        errors every rank raises alike are isolated: Python-level ones (TypeError, ValueError, IndexError, ...).
        A RuntimeError there may be one rank's alone (CUDA or host OOM, a device fault): redoing the work on that
        rank only would put the ranks' collectives out of step, so it is fatal, as a lost rank is."""
        if not self.isolate or isinstance(e, CollectiveFailed) or (self.across_ranks and isinstance(e, RuntimeError)):
            raise e
