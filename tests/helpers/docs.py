"""The docs pages' code blocks, run as a reader runs them: each page in order, in a directory of its own, every server
it needs started by the page's own text, nothing else (no port or name the page does not show).

A block's note, the HTML comment on the line before it, says what happens to it:
- `<!-- starts a server in tests/test_docs.py -->`: the block's text runs in bash and keeps running: it is ready
  once each `logitserve serve` in it says `logitserve: serving ...` and every port the block names accepts
  connections (a router's `--port` too). A server still running from an earlier block, or from an earlier page
  whose block was the same text, is used again; a running one holding a port this block names is stopped first, as
  the page's reader stops it (the pages say so).
- `<!-- runs in tests/test_docs.py ... -->`: bash (`-e -o pipefail`) or python, against the servers the page has
  started; it must exit 0 (a curl block's answers must not be errors). A page that runs a block before starting any
  server fails.
- `<!-- not run: why -->`: not run; the reason is required.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parent.parent.parent
BLOCK = re.compile(r"(?:<!-- (?P<note>[^>]*) -->\n[ \t]*)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
RUNS, STARTS, NOT_RUN = "runs in tests/test_docs.py", "starts a server in tests/test_docs.py", "not run:"
SERVING = re.compile(r"logitserve: serving \S+ on \S+:\d+")
SERVE_LINE = re.compile(r"(^|[\s/])logitserve serve\b")
START_S = 240       # a server's start, the demo built first included, on CI's two cores


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.parts)]


@dataclass(frozen=True)
class Block:
    page: Path
    note: str
    lang: str
    body: str
    line: int           # the block's first line in its page, 1-based

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, m.group("note") or "", m.group("lang"), m.group("body"),
                  text.count("\n", 0, m.start("body")) + 1) for m in BLOCK.finditer(text)]


def _port(line: str, flag: str) -> Optional[int]:
    m = re.search(rf"{flag}[ =](\d+)", line)
    return int(m.group(1)) if m else None


def ports_of(body: str) -> set[int]:
    """The ports a starts block's servers listen on: each `logitserve serve`'s --port (50051 unless given),
    --http-port and --metrics-port; any other command's --port (a router)."""
    ports = set()
    for line in body.splitlines():
        if SERVE_LINE.search(line):
            ports.add(_port(line, "--port") or 50051)
            ports |= {p for p in (_port(line, "--http-port"), _port(line, "--metrics-port")) if p}
        elif _port(line, "--port"):
            ports.add(_port(line, "--port"))
    return ports - {0}


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class Started:
    """One starts block, running in its own process group; ready when constructed (or RuntimeError, its log)."""

    def __init__(self, block: Block, cwd: Path, env: dict):
        self.block, self.ports, self.log = block, ports_of(block.body), []
        taken = sorted(p for p in self.ports if _listening(p))
        if taken:
            raise RuntimeError(f"{block.where}: port(s) {taken} are taken by another program: stop it first")
        self.proc = subprocess.Popen(["bash", "-e", "-c", block.body], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        servers = sum(bool(SERVE_LINE.search(line)) for line in block.body.splitlines())
        serving = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(servers, serving), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and not (serving.is_set() and all(map(_listening, self.ports))):
            if not self._reader.is_alive():
                break
            time.sleep(0.2)
        if not (serving.is_set() and all(map(_listening, self.ports))):
            self.stop()
            raise RuntimeError(f"{block.where}: the server did not start:\n{block.body}\n{''.join(self.log)[-4000:]}")

    def _read(self, servers: int, serving: threading.Event) -> None:
        seen = 0
        if not servers:
            serving.set()
        for line in self.proc.stdout:
            self.log.append(line)
            if SERVING.search(line):
                seen += 1
                if seen >= servers:
                    serving.set()

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(map(_listening, self.ports)):
            time.sleep(0.2)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)     # whatever did not drain by now
        except ProcessLookupError:
            pass
        self.proc.wait(30)


@dataclass
class PageRun:
    page: Path
    ran: int = 0
    started: int = 0
    reused: int = 0
    not_run: int = 0


class Servers:
    """The servers started so far, by their block's text; the ones holding a port a new block names are stopped."""

    def __init__(self):
        self.running: dict[str, Started] = {}

    def start(self, block: Block, cwd: Path, env: dict) -> bool:
        """True when started now, False when the same text was already running."""
        if block.body in self.running and all(map(_listening, self.running[block.body].ports)):
            return False
        wanted = ports_of(block.body)
        for body, s in list(self.running.items()):
            if s.ports & wanted or body == block.body:
                s.stop()
                del self.running[body]
        self.running[block.body] = Started(block, cwd, env)
        return True

    def stop(self) -> None:
        for s in self.running.values():
            s.stop()
        self.running.clear()


def env_for(python: str) -> dict:
    """The environment a reader has after activating the venv of `python`: its bin first on PATH."""
    return {**os.environ, "PATH": f"{Path(python).parent}{os.pathsep}{os.environ['PATH']}"}


def run_page(page: Path, servers: Servers, workdir: Path, python: str = sys.executable,
             select: Callable[[Block], bool] = lambda b: True, skip: Callable[[Block], bool] = lambda b: False
             ) -> PageRun:
    """Every block of `page` in order (those `select` keeps): servers started, blocks run; AssertionError naming the
    block that failed. `skip`: run blocks left out here (their reason is the caller's)."""
    env, done, started = env_for(python), PageRun(page), False
    workdir.mkdir(parents=True, exist_ok=True)
    for b in blocks(page):
        if not select(b):
            continue
        if b.note.startswith(STARTS):
            fresh = servers.start(b, workdir, env)
            done.started, done.reused, started = done.started + fresh, done.reused + (not fresh), True
        elif b.note.startswith(RUNS) and not skip(b):
            assert started, f"{b.where}: a block runs before the page shows the command that starts its server"
            _run_block(b, workdir, env, python)
            done.ran += 1
        else:
            done.not_run += 1
    return done


def _run_block(b: Block, cwd: Path, env: dict, python: str) -> None:
    cmd = ["bash", "-e", "-o", "pipefail", "-c", b.body] if b.lang == "bash" else [python, "-c", b.body]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert run.returncode == 0, f"{b.where}: block failed:\n{b.body}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    if b.lang == "bash" and "curl" in b.body:       # curl exits 0 on an HTTP error: the answers must not be errors
        assert '"error"' not in run.stdout and "Internal Server Error" not in run.stdout, f"{b.where}:\n{run.stdout}"
