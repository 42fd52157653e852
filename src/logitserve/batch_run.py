"""A batch in progress: which of its jobs were skipped or failed, and whether a failure stays with its job."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterator, Optional

import torch

from .collectives import CollectiveFailed
from .errors import OverLimit

if TYPE_CHECKING:
    from .engine import Step
    from .spec import Job

_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


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
    """A batch in progress: its jobs, which were skipped or failed, and whether failures stay with their job."""

    def __init__(self, jobs: list[Job], skip: Callable[[int], bool], isolate: bool, across_ranks: bool = False):
        self.jobs = jobs
        self.skip = skip
        self.isolate = isolate
        self.across_ranks = across_ranks
        self.failed: set[int] = set()

    def live(self, j: int) -> bool:
        return j not in self.failed and not self.skip(j)

    def guard(self, j: int, steps: Iterator[Step]) -> Iterator[Step]:
        """The job's steps until it is skipped; with isolate, an exception becomes one error Step."""
        try:
            for step in steps:
                yield step
                if not self.live(j):
                    return
        except Exception as e:
            from .engine import Step

            self.reraise_unless_isolated(e)
            self.failed.add(j)
            yield Step((j,), errors=((j, _out_of_memory(e) or e),))

    def reraise_unless_isolated(self, e: Exception) -> None:
        """A job's own error stays with the job (when isolating); a failed collective never does. Across ranks only
        errors every rank raises alike are isolated: Python-level ones (TypeError, ValueError, IndexError, ...).
        A RuntimeError there may be one rank's alone (CUDA or host OOM, a device fault): redoing the work on that
        rank only would put the ranks' collectives out of step, so it is fatal, as a lost rank is."""
        if not self.isolate or isinstance(e, CollectiveFailed) or (self.across_ranks and isinstance(e, RuntimeError)):
            raise e

