"""How the scheduler runs a batch in this process, and the hook that lets small jobs run between its steps.

A `BatchRun` is `(jobs, skip, between=None, short=False) -> events`. After each step the runner calls
`between()`; when the scheduler answers with a `Nested`, the runner hands it a runner for
one batch run inline, at this step boundary (depth one: that batch gets no `between`), then
goes on with its own steps. A distributed runner does the same on every rank
(logitserve.distributed); under --pp the nested batch's activations travel on a group of
their own, apart from the outer batch's still in flight (logitserve.pipeline).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional

from logitserve.events import Event

# (jobs, skip[, between, short]) -> the batch's events: its jobs' pieces, shared tokens and failures (a StageTime is
# the runner's). `skip(i)`: job i is dropped from the work not yet done. `short`: run it in short head steps
# (Engine.batch_steps).
BatchRun = Callable[..., Iterator[Event]]
# The scheduler's batch to run now, given the runner that runs it inline between two steps.
Nested = Callable[[BatchRun], None]
Between = Callable[[], Optional[Nested]]


def engine_batch_runner(batch_steps) -> BatchRun:
    """Run a batch through an Engine's `batch_steps` in this process; a failing job fails alone."""
    def run(jobs: list, skip: Callable[[int], bool], between: Optional[Between] = None,
            short: bool = False) -> Iterator[Event]:
        steps = batch_steps(jobs, skip, short=short)
        try:
            for step in steps:
                yield from step.events_and_done()
                nested = between() if between is not None else None
                if nested is not None:
                    nested(run)
        finally:
            steps.close()
    return run
