"""The README's runnable blocks, run as written against `logitserve serve` on 127.0.0.1:50051, so the README
cannot drift from the code. A block runs when the line before it says `<!-- runs in tests/test_readme.py -->`;
every complete Python example (one that starts with an import) is either run or says why not."""
from __future__ import annotations

import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import CliServer


README = (Path(__file__).parent.parent / "README.md").read_text()
BLOCK = re.compile(r"(?:<!-- (?P<note>[^>]*) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
RUNS = "runs in tests/test_readme.py"


def blocks():
    for m in BLOCK.finditer(README):
        yield m.group("note") or "", m.group("lang"), m.group("body")


@pytest.mark.unit
def test_every_complete_python_example_is_run_or_says_why_not():
    complete = [(note, body) for note, lang, body in blocks() if lang == "python"
                and re.match(r"(import|from) ", body)]
    assert complete
    for note, body in complete:
        assert note.startswith(RUNS) or note.startswith("not run:"), body.splitlines()[0]
    assert sum(note.startswith(RUNS) for note, _, _ in blocks()) >= 3


@pytest.fixture(scope="module")
def on_50051():
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 50051)) == 0:
            raise RuntimeError("port 50051 is taken: the README's examples dial it; stop that server first")
    server = CliServer("--port", "50051", "--http-port", "8000")
    yield server
    assert server.stop() == 0


@pytest.mark.live_server
def test_readme_blocks_run_as_written(on_50051):
    ran = 0
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for note, lang, body in blocks():
        if not note.startswith(RUNS):
            continue
        if "tritonclient" in note and importlib.util.find_spec("tritonclient") is None:
            continue      # the same calls run in tests/test_coexistence.py, which installs tritonclient
        cmd = ["bash", "-e", "-c", body] if lang == "bash" else [sys.executable, "-c", body]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert run.returncode == 0, f"README block failed:\n{body}\n{run.stderr[-2000:]}"
        ran += 1
    assert ran >= 2
