"""Starts the ranks of a tp x cp server on one machine and watches them: one dies, all stop, loudly."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

log = logging.getLogger("logitserve.launch")
# After one rank ends, the others get this long to notice and exit on their own before they are killed.
GRACE_S = 15.0


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_local(serve_argv: list[str], world: int, threads: int | None) -> int:
    """Run `logitserve serve ...` as `world` rank processes; return the exit code for the whole server."""
    threads = threads or max(1, (os.cpu_count() or 1) // world)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": str(threads)}
        procs.append(subprocess.Popen([sys.executable, "-m", "logitserve.server.cli", "serve", *serve_argv],
                                      env=env))

    def forward(signum, _frame):   # rank 0 stops the others through the process group
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)

    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    first = next(p for p in procs if p.poll() is not None)
    if first.returncode != 0:
        log.error("rank %d exited with %s; stopping the server", procs.index(first), first.returncode)
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            log.error("rank %d did not exit; killing it", procs.index(p))
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    return 0 if all(c == 0 for c in codes) else (next((c for c in codes if c > 0), 1))
