"""Cuts one request's per-sequence arguments into parts, and puts the parts' results back in request order."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import grpc

from .assemble import ForwardResult
from .errors import LogitServeError
from .wire import Wanted


def check_per_sequence(wanted: Wanted, n: int) -> None:
    """The per-sequence arguments hold one entry per sequence (as build_request checks for a whole request)."""
    for name in ("prompt_lengths", "candidates"):
        value = getattr(wanted, name)
        if value is not None and len(value) != n:
            raise ValueError(f"{name}: {len(value)} given for {n} sequences")


def cut(wanted: Wanted, index: Sequence[int]) -> Wanted:
    """The request's arguments for the sequences at `index`, in that order."""
    cuts = {name: [getattr(wanted, name)[i] for i in index] for name in ("prompt_lengths", "candidates")
            if getattr(wanted, name) is not None}
    return dataclasses.replace(wanted, **cuts) if cuts else wanted


def merge(n: int, parts: Sequence[tuple[Sequence[int], ForwardResult]]) -> ForwardResult:
    """One ForwardResult of `n` sequences from parts that each served the sequences at their index."""
    first = parts[0][1]
    for _, r in parts[1:]:
        if r.model != first.model:     # replicas are checked on admission; a result says which model made it
            raise LogitServeError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"one request was served by two models: {first.model} and {r.model}")
    out = ForwardResult(applied=first.applied, model=first.model, batching=first.batching,
                        shared_prefix_tokens=sum(r.shared_prefix_tokens for _, r in parts))
    for f in dataclasses.fields(ForwardResult):
        if not isinstance(getattr(first, f.name), list):
            continue
        arrays = [None] * n
        for index, r in parts:
            for j, i in enumerate(index):
                arrays[i] = getattr(r, f.name)[j]
        setattr(out, f.name, arrays)
    return out
