"""The README and every docs/ page: the site builds with `mkdocs build --strict`, the reference pages equal what
docs/gen_reference.py makes now, and every runnable block runs as written against `logitserve serve`.

A block runs when the line before it says `<!-- runs in tests/test_docs.py ... -->`: against a server on
127.0.0.1:50051 with HTTP on 8000, or the note names a token server (50061, HTTP 8001, token `secret-token-1`) or
a reward server (50071, HTTP 8002). `<!-- starts a server in tests/test_docs.py -->` blocks run until the server
says it is serving, then get SIGTERM. Every complete Python example, and every bash block that starts a server or
calls one, either runs or says `not run:` and why."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import CliServer

pytestmark = pytest.mark.live_server

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- (?P<note>[^>]*) -->\n[ \t]*)?```(?P<lang>\w*)\n(?P<body>.*?)```", re.S)
RUNS, STARTS = "runs in tests/test_docs.py", "starts a server in tests/test_docs.py"
TOKEN = "secret-token-1"
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def blocks():
    for page in PAGES:
        for m in BLOCK.finditer(page.read_text()):
            yield page.relative_to(ROOT), m.group("note") or "", m.group("lang"), m.group("body")


def test_reference_pages_are_what_the_cli_and_the_proto_say_now():
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_reference.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    cli = (ROOT / "docs" / "reference" / "cli.md").read_text()
    for flag in ("--http-port", "--served-model-name", "--pp", "--pp-balance", "--debug", "--auth-token-file"):
        assert f"`{flag} " in cli or f"`{flag}`" in cli, flag


def test_the_site_builds_strict_with_every_page_in_the_nav(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env={**ENV, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"


def test_every_example_is_run_or_says_why_not():
    for page, note, lang, body in blocks():
        complete = lang == "python" and re.match(r"(import|from) ", body)
        serving = lang == "bash" and re.search(r"^\s*(curl|logitserve (info|query|health|capture))", body, re.M)
        if complete or serving:
            assert note.startswith((RUNS, STARTS, "not run:")), f"{page}: {body.splitlines()[0]}"
    assert sum(note.startswith(RUNS) for *_, note, _, _ in ((p, n, lang, b) for p, n, lang, b in blocks())) >= 10


def test_make_serve_opens_the_http_port():
    run = subprocess.run(["make", "-n", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and re.search(r"logitserve serve --http-port 8000\s*$", run.stdout, re.M), run.stdout


def _free(port: int) -> None:
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is taken: the docs' examples dial it; stop that server first")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("docs-blocks")


def test_server_blocks_start_as_written(workdir):
    """`logitserve serve ...` blocks (README, serving.md) run in a fresh directory until the server serves."""
    seen = set()
    for page, note, lang, body in blocks():
        if not note.startswith(STARTS) or body in seen:
            continue
        seen.add(body)
        _free(50051), _free(8000)
        proc = subprocess.Popen(["bash", "-e", "-c", body], cwd=workdir, env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        log, deadline = [], time.monotonic() + 240
        try:
            while time.monotonic() < deadline:
                line = proc.stdout.readline()
                if not line:
                    break
                log.append(line)
                if re.search(r"logitserve: serving \S+ on [\d.]+:50051 \(HTTP on port 8000\)", line):
                    break
            assert log and "serving" in log[-1], f"{page}: the server did not start:\n{body}\n{''.join(log)[-3000:]}"
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
    assert seen


@pytest.fixture(scope="module")
def servers(workdir):
    _free(50051), _free(8000)
    made: dict[str, CliServer] = {"main": CliServer("--port", "50051", "--http-port", "8000")}
    tokens = workdir / "tokens.txt"
    tokens.write_text(TOKEN + "\n")
    starts = {"auth-token-file": ("--port", "50061", "--http-port", "8001", "--auth-token-file", str(tokens)),
              "reward server": ("--demo", "reward", "--port", "50071", "--http-port", "8002")}

    def server(note: str) -> CliServer:
        for key, args in starts.items():
            if key in note and key not in made:
                made[key] = CliServer(*args)
        return made["main"]

    yield server
    for s in made.values():
        assert s.stop() == 0


def test_doc_blocks_run_as_written(servers, workdir):
    ran = 0
    for page, note, lang, body in blocks():
        if not note.startswith(RUNS):
            continue
        if "tritonclient" in note and importlib.util.find_spec("tritonclient") is None:
            continue      # the same calls run in tests/test_coexistence.py, which installs tritonclient
        servers(note)
        script = "set -o pipefail\n" + body if lang == "bash" else body
        cmd = ["bash", "-e", "-c", script] if lang == "bash" else [sys.executable, "-c", body]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=workdir)
        assert run.returncode == 0, f"{page}: block failed:\n{body}\n{run.stdout[-1500:]}\n{run.stderr[-2000:]}"
        if lang == "bash" and "curl" in body:       # curl exits 0 on an HTTP error: the answers must not be errors
            assert '"error"' not in run.stdout and "Internal Server Error" not in run.stdout, f"{page}:\n{run.stdout}"
        ran += 1
    assert ran >= 10
