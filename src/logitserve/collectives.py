"""The model's collectives, so that their failure is told apart from a request's own error.

A collective that fails or times out (gloo/NCCL raise plain RuntimeErrors) means the ranks are out of
step: it becomes `CollectiveFailed`, which the engine never isolates to one request, and the server
treats as a lost rank. A Python-level exception raised by every rank alike for one request ends only
that request (logitserve.engine, isolate); across ranks a RuntimeError (an OOM or device fault may hit
one rank alone) is fatal too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class CollectiveFailed(RuntimeError):
    """A collective failed or timed out: some rank is gone or the ranks are out of step."""


def _failed(name: str, e: Exception) -> CollectiveFailed:
    first = (str(e).splitlines() or [""])[0][:300]
    return CollectiveFailed(f"{name} failed: {type(e).__name__}: {first}")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """In place, as dist.all_reduce."""
    try:
        dist.all_reduce(t, op=op, group=group)
    except Exception as e:   # noqa: BLE001 (backends raise RuntimeError subclasses or plain RuntimeError)
        raise _failed("all_reduce", e) from e


def all_gather(parts: list[torch.Tensor], t: torch.Tensor, group=None) -> None:
    """Into `parts`, as dist.all_gather."""
    try:
        dist.all_gather(parts, t, group=group)
    except Exception as e:   # noqa: BLE001
        raise _failed("all_gather", e) from e
