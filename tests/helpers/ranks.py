"""Gloo ranks for a test: `world` spawned processes on a free loopback port, and what rank 0 reports back."""
from __future__ import annotations

import socket

import torch.multiprocessing as mp


def run_ranks(target, world: int, *args, timeout: float = 120.0):
    """Run target(rank, port, *args, out) in `world` spawned processes (port: a free MASTER_PORT on loopback) and
    return the one object a rank puts on `out`; every process must exit 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=timeout)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result
