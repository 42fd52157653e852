"""Replica agreement: every replica of a pool serves the same weights, and (with a probe) the same logprobs."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Optional, Sequence

import grpc
import numpy as np

from .errors import LogitServeError, ReplicasDisagree
from .wire import Wanted


@dataclass(frozen=True)
class Agreement:
    hashes: dict                  # address -> content_hash (blake2b of the weight files), every replica that answered
    unreachable: tuple            # (address, ...) that did not answer ModelInfo within the timeout
    max_logprob_diff: Optional[float] = None   # with a probe: max over replicas and positions of |lp - lp_first|


async def check_agreement(replicas: Sequence, probe: Optional[Sequence[int]], atol: Optional[float],
                          timeout: float) -> Agreement:
    """ModelInfo from each replica (`.address`, `.client`); ReplicasDisagree naming every address and hash when
    the hashes differ; the probe's logprobs from each, compared."""
    infos = await asyncio.gather(*(r.client.model_info(timeout) for r in replicas), return_exceptions=True)
    answered = [(r, i) for r, i in zip(replicas, infos) if not isinstance(i, BaseException)]
    unreachable = tuple(r.address for r, i in zip(replicas, infos) if isinstance(i, BaseException))
    for r, i in zip(replicas, infos):
        if isinstance(i, BaseException) and not isinstance(i, LogitServeError):
            raise i
    hashes = {r.address: i.content_hash for r, i in answered}
    if len(set(hashes.values())) > 1:
        raise ReplicasDisagree(hashes, {r.address: i.name for r, i in answered})
    if probe is None or not answered:
        return Agreement(hashes, unreachable)
    w = Wanted(logprobs=True, timeout_s=timeout)
    outs = await asyncio.gather(*(r.client.submit([probe], w) for r, _ in answered))
    first = outs[0].logprobs[0]
    diff = 0.0
    for (r, _), out in zip(answered[1:], outs[1:]):
        lp = out.logprobs[0]
        if not np.array_equal(np.isfinite(first), np.isfinite(lp)):
            diff = float("inf")
            continue
        finite = np.isfinite(first)
        if finite.any():
            diff = max(diff, float(np.max(np.abs(first[finite].astype(np.float64) - lp[finite]))))
    if atol is not None and diff > atol:
        raise LogitServeError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"replicas give different logprobs on the probe: max |difference| {diff:.3g} > "
                              f"atol {atol:g} across {', '.join(hashes)} (same content_hash: check dtype, "
                              f"batching and device)")
    return Agreement(hashes, unreachable, diff)
