"""Servers the tests start: in-process on loopback, `logitserve serve` as a process, under torchrun; their RSS."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from .models import ServerThread

MiB = 2 ** 20
# What RSS may exceed --memory-budget by: the request messages being received and decoded before they are
# admitted (one per stream at a time), the allocator's slack, and one head chunk's temporaries.
OVERHEAD = 512 * MiB


def serve_dir(directory, chunk_size=16, batching="packed", max_pack_tokens=16384, min_shared_prefix=64,
              step_separator=None, **server_kw):
    """An in-process server (a ServerThread) on the model in `directory`, with these engine settings
    (step_separator: --step-separator's value, for token-classification models)."""
    from logitserve.engine import Batching, EngineConfig
    from logitserve.loaded import with_step_separator
    from logitserve.loading import load_model
    from logitserve.server.config import ServerConfig

    loaded = load_model(directory)
    if step_separator is not None:
        loaded = with_step_separator(loaded, step_separator)
    engine = EngineConfig(chunk_size=chunk_size, batching=Batching(batching), max_pack_tokens=max_pack_tokens,
                          min_shared_prefix=min_shared_prefix)
    return ServerThread(loaded, ServerConfig(port=0, engine=engine, **server_kw))


class CliServer:
    """`logitserve serve` in its own process, as a user starts it."""

    def __init__(self, *args: str, python: str = sys.executable):
        if "--device" not in args:   # CPU unless asked (bench/gpu_check.sh sets LOGITSERVE_TEST_DEVICE=cuda)
            args = (*args, "--device", os.environ.get("LOGITSERVE_TEST_DEVICE", "cpu"))
        self.proc = subprocess.Popen([python, "-m", "logitserve.server.cli", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + 180
        self.log = []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
            if m:
                self.address = f"127.0.0.1:{m.group(1)}"
                http = re.search(r"\(HTTP on port (\d+)\)", line)
                self.http = f"http://127.0.0.1:{http.group(1)}" if http else None
                threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()
                return
        self.proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


class TorchrunServer:
    """`logitserve serve` as two torchrun agents on this machine, as on two nodes: `--nnodes 2`, `nproc` ranks each,
    c10d rendezvous on localhost (the README's multi-node command). The gRPC port opens on global rank 0, in
    whichever agent c10d ranked first; stop() sends SIGTERM to that rank, which drains and stops the rest."""

    def __init__(self, *args: str, nproc: int = 2, rdzv: str = "c10d"):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.agents, self.logs, self.address, self.http = [], [[], []], None, None
        found = threading.Event()
        for node in range(2):
            if rdzv == "c10d":
                rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                              "--rdzv-id", f"logitserve-{port}", "--rdzv-conf", f"is_host={int(node == 0)}"]
            else:                       # static: --node-rank decides, node 0 holds rank 0
                rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(nproc),
                   "--node-rank", str(node), *rendezvous, "-m", "logitserve.server.cli", "serve",
                   "--host", "127.0.0.1", "--port", "0", *args]
            agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
            self.agents.append(agent)
            threading.Thread(target=self._read, args=(agent, self.logs[node], found), daemon=True).start()
        if not found.wait(240):
            self._kill()
            raise RuntimeError("torchrun server did not start:\n" + "".join(self.logs[0] + self.logs[1])[-6000:])

    def _read(self, agent, log, found) -> None:
        for line in agent.stdout:
            log.append(line)
            m = re.search(r"logitserve: serving \S+ on [\d.]+:(\d+)", line)
            if m and not found.is_set():
                self.address = f"127.0.0.1:{m.group(1)}"
                http = re.search(r"\(HTTP on port (\d+)\)", line)
                self.http = f"http://127.0.0.1:{http.group(1)}" if http else None
                found.set()

    @property
    def log(self) -> list:
        return self.logs[0] + self.logs[1]

    def rank0(self):
        """The worker process that listens on the gRPC port."""
        import psutil

        port = int(self.address.rsplit(":", 1)[1])
        for agent in self.agents:
            for child in psutil.Process(agent.pid).children(recursive=True):
                try:
                    if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections()):
                        return child
                except psutil.Error:
                    continue
        raise RuntimeError(f"no worker listens on {self.address}")

    def _kill(self) -> None:
        for agent in self.agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)

    def stop(self, timeout: float = 60) -> int:
        """Both agents' worst exit code (0: every rank exited 0)."""
        try:
            self.rank0().send_signal(signal.SIGTERM)
            codes = [agent.wait(timeout) for agent in self.agents]
        except Exception:
            self._kill()
            raise
        return max(codes, key=abs)


def _tree(pid: int) -> list[int]:
    """pid and its descendants (a TP server's ranks are the launcher's children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class Rss:
    """The server's resident memory (its process and their children: every rank), sampled every 20 ms: `peak`
    of the sum since start()."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def now(self) -> int:
        total = 0
        for p in _tree(self.pid):
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * 4096
            except OSError:
                pass
        return total

    def __enter__(self):
        self.base = self.peak = self.now()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.now())
            except OSError:
                return
            time.sleep(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base
