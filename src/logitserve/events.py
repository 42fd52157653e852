"""What a batch's run sends from the engine to the scheduler's tickets, under every layout: typed events.

A rank's run of a batch is a sequence of `Step`s (the same count on every rank, so a
distributed runner gathers step by step); each step carries this rank's events. An event
for a job names it by its index in the batch; `StageTime` belongs to the batch (--pp).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Union

import torch

from .spec import OutputKind


@dataclass(frozen=True)
class Piece:
    """One rectangle of one output of one sequence."""

    output: OutputKind
    sequence: int
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor    # contiguous, CPU, wire dtype; shape = extent of the rectangle


@dataclass(frozen=True)
class JobPiece:
    """A piece of job `job`'s outputs."""

    job: int
    piece: Piece


@dataclass(frozen=True)
class SharedTokens:
    """Tokens of job `job`'s sequences computed once for a group (a shared prefix); goes down its stream."""

    job: int
    tokens: int


@dataclass(frozen=True)
class JobFailed:
    """Job `job` failed on its own (its request's error, or memory for it alone); the batch's others go on."""

    job: int
    error: BaseException


@dataclass(frozen=True)
class JobDone:
    """Job `job`'s outputs are complete: its stream may end now, before the rest of its batch (a runner emits it
    after the step whose `done` names the job, once every rank's events of that step are out)."""

    job: int


@dataclass(frozen=True)
class StageTime:
    """--pp: ends a batch from every stage: seconds this stage computed, and its batch's wall time from its first
    micro-batch to its last step. The runner turns them into the batch's bubble fraction."""

    stage: int
    busy_s: float
    wall_s: float


Event = Union[JobPiece, SharedTokens, JobFailed, JobDone, StageTime]


@dataclass(frozen=True)
class Step:
    """One step of a batch. `jobs` is the same on every rank; `events` are this rank's."""

    jobs: tuple[int, ...]              # the jobs this step computed for
    events: tuple[Event, ...] = ()
    done: tuple[int, ...] = ()         # jobs with nothing left to compute after this step (the same on every rank)

    def events_and_done(self) -> Iterator[Event]:
        """What a runner hands on for this step when its events are this rank's alone."""
        yield from self.events
        yield from (JobDone(j) for j in self.done)


def pieces_of(job: int, pieces: list[Piece]) -> tuple[JobPiece, ...]:
    return tuple(JobPiece(job, p) for p in pieces)
