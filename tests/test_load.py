"""Load: many concurrent streams of mixed requests; no errors but the configured RESOURCE_EXHAUSTED, bounded
server RSS, and every response equal to the same request served alone afterwards (packed mode, the default:
within the packed bound; the bitwise batch invariance of exact mode is tested in test_scheduler).

The short version runs in CI; the full one (64 streams, 60 s) is marked slow: `make load-test`.
"""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import psutil
import pytest

from helpers import CliServer, random_request, within_packed_bound
from logitserve.client import AsyncTeacherClient, LogitServeError, TeacherClient

pytestmark = pytest.mark.live_server

MAX_QUEUED = 6000   # small enough that a burst is refused with RESOURCE_EXHAUSTED


def _load(model_dir, streams: int, seconds: float) -> None:
    server = CliServer("--model", str(model_dir), "--logprob-chunk-size", "16", "--max-queued-tokens", str(MAX_QUEUED))
    proc = psutil.Process(server.proc.pid)
    rng = np.random.default_rng(41)
    pool = [random_request(rng) for _ in range(80)]
    results, errors, refused = [], [], []
    rss = {"idle": proc.memory_info().rss, "peak": 0}
    sampling = threading.Event()

    def sample():
        while not sampling.is_set():
            rss["peak"] = max(rss["peak"], proc.memory_info().rss)
            time.sleep(0.1)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()

    async def stream(i: int, stop_at: float) -> None:
        local = np.random.default_rng(i)
        async with AsyncTeacherClient(server.address) as c:
            while time.monotonic() < stop_at:
                j = int(local.integers(len(pool)))
                try:
                    results.append((j, await c.forward(**pool[j])))
                except LogitServeError as e:
                    (refused if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED else errors).append(e)
                    if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        await asyncio.sleep(0.05)

    async def main():
        stop_at = time.monotonic() + seconds
        await asyncio.wait_for(asyncio.gather(*(stream(i, stop_at) for i in range(streams))), seconds + 120)

    try:
        asyncio.run(main())
        sampling.set()
        sampler.join()
        with TeacherClient(server.address) as c:
            alone = {j: c.forward(**pool[j]) for j in sorted({j for j, _ in results})}
    finally:
        assert server.stop() == 0
    print(f"\n{streams} streams x {seconds:.0f} s: {len(results)} responses, {len(refused)} refused "
          f"(RESOURCE_EXHAUSTED), server RSS idle {rss['idle'] / 2**20:.0f} MiB, peak {rss['peak'] / 2**20:.0f} MiB")
    assert not errors, errors[:3]
    assert len(results) >= streams
    for e in refused:   # every stream is one client here (127.0.0.1): its share is half the queue
        assert (f"--max-queued-tokens {MAX_QUEUED}" in e.details
                or f"--max-queued-tokens-per-client {MAX_QUEUED // 2}" in e.details), e.details
    for j, got in results:
        within_packed_bound(got, alone[j])
    assert rss["peak"] - rss["idle"] < 1 << 30


def test_load_short_mixed_streams(model_dirs):
    _load(model_dirs["llama"], streams=16, seconds=8)


@pytest.mark.slow
def test_load_64_streams_for_60_seconds(model_dirs):
    _load(model_dirs["llama"], streams=64, seconds=60)
