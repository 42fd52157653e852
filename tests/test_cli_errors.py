"""Issue 45's CLI cases, each typed once as a new user would: every start-up and client error is one `logitserve: ...`
line naming the flag and what to do (no traceback, no gRPC C-core line), said before any model loads; --version;
a refused connection said at once; a wait only for a server that answers it is loading; a closed pipe is quiet;
`serve --help` grouped by task, one screen a group."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

CLI = [sys.executable, "-m", "logitserve.server.cli"]
ENV = {**os.environ, "COLUMNS": "100"}


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV)


def _one_line(run: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The command failed with `code`, its stderr one `logitserve: ` line holding every word, nothing loaded."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == code, (run.returncode, run.stderr)
    assert len(lines) == 1 and lines[0].startswith("logitserve: "), run.stderr
    assert "Traceback" not in run.stderr and "loading on" not in run.stdout, run.stdout + run.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.live_server
def test_serve_flag_errors_are_one_line_naming_the_flag_before_anything_loads(tmp_path):
    """Each of the issue's serve cases, run at once (each is a `logitserve serve` that must stop before loading)."""
    model = tmp_path / "my-model"
    cases = {
        ("--port", "99999"): (2, "--port", "'99999' is not a port", "65535"),
        ("--memory-budget", "lots"): (2, "--memory-budget", "'lots' is not a size", "2GiB"),
        ("--demo", "reward", "--model", str(model)): (2, "--demo reward", "--model", "drop one"),
        ("--demo-shape", "body", "--model", str(model)): (2, "--demo-shape body", "--model"),
        ("--http-port", "50051"): (2, "--http-port 50051 is --port too", "choose another --http-port"),
        ("--port", "0", "--metrics-port", "7", "--http-port", "7"): (2, "--metrics-port 7 is --http-port too"),
        ("--port", "0", "--host", "192.0.2.1"): (2, "--host 192.0.2.1: not an address of this machine", "127.0.0.1"),
        ("--port", "0", "--host", "no-such-host.invalid"): (2, "--host no-such-host.invalid", "resolves"),
        ("--port", "0", "--auth-token-file", str(tmp_path / "missing.txt")): (2, "--auth-token-file", "no such file"),
        ("--port", "0", "--tls-cert", str(tmp_path / "c.pem")): (2, "--tls-cert needs --tls-key"),
        ("--port", "0", "--step-separator", "<extra_0>"): (2, "--step-separator", "--demo prm"),
        ("--port", "0", "--prot", "5"): (2, "unrecognized arguments: --prot 5", "logitserve serve --help"),
        ("--port", "0", "--tp", "0"): (2, "--tp", "at least 1"),
    }
    (tmp_path / "empty.txt").write_text("\n")
    cases[("--port", "0", "--auth-token-file", str(tmp_path / "empty.txt"))] = (2, "--auth-token-file", "no token")
    (tmp_path / "c.pem").write_text("not a certificate\n")
    cases[("--port", "0", "--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "c.pem"))] = \
        (2, "--tls-cert", "not a PEM certificate chain")
    runs = {args: subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env=ENV) for args in cases}
    for args, proc in runs.items():
        out, err = proc.communicate(timeout=120)
        code, *words = cases[args]
        _one_line(subprocess.CompletedProcess(args, proc.returncode, out, err), code, *words)


@pytest.mark.live_server
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA GPU is here: --device cuda serves")
def test_device_cuda_without_a_gpu_is_one_line():
    _one_line(_run("serve", "--port", "0", "--device", "cuda"), 2, "--device cuda: no CUDA GPU here", "--device cpu")


@pytest.mark.live_server
def test_busy_ports_are_one_line_naming_their_flag_before_loading():
    """--metrics-port on a busy port failed after the model loaded with a bare OSError; --port / --http-port on a
    port another program holds, one line and exit 1 (no gRPC C-core line)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = str(s.getsockname()[1])
        for flag in ("--metrics-port", "--http-port", "--port"):
            args = ("--port", "0", flag, busy) if flag != "--port" else ("--port", busy)
            line = _one_line(_run("serve", *args), 1, f"{flag} {busy}", "in use", f"choose another {flag}")
            assert "E0000" not in line and "chttp2" not in line


@pytest.mark.unit
def test_version_and_help_of_every_command():
    from logitserve import __version__

    run = _run("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"logitserve {__version__}"
    for command in ("export-demo", "info", "query", "health", "capture"):
        text = _run(command, "--help").stdout
        for line in re.findall(r"^  (-\S+|[a-zA-Z]\S*)(.*)$", text, re.M):
            assert line[1].strip() or "help" in line[0], (command, line)     # no flag without its help


@pytest.mark.live_server
def test_capture_of_a_missing_input_is_one_line():
    _one_line(_run("capture", "127.0.0.1:1", "--input", "nope.jsonl", "--out", "o"), 1, "--input nope.jsonl",
              "no such file")


@pytest.mark.live_server
def test_a_refused_connection_is_said_at_once_and_an_http_port_is_named(demo_cli_server):
    """`query` against a port where nothing listens waited silently for 600 s; the HTTP port by mistake too."""
    port = _free_port()
    for command in (("query", f"127.0.0.1:{port}", "--ids", "1 5"), ("info", f"127.0.0.1:{port}")):
        t0 = time.monotonic()
        _one_line(_run(*command), 1, f"nothing listens on 127.0.0.1:{port}")
        assert time.monotonic() - t0 < 20
    with socket.socket() as s:                 # something that answers, but not gRPC (an HTTP/1 server's socket)
        s.bind(("127.0.0.1", 0))
        s.listen()
        stop = threading.Event()

        def answer_http():
            s.settimeout(0.2)
            while not stop.is_set():
                try:
                    conn, _ = s.accept()
                except OSError:
                    continue
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                conn.close()
        thread = threading.Thread(target=answer_http, daemon=True)
        thread.start()
        try:
            t0 = time.monotonic()
            _one_line(_run("info", f"127.0.0.1:{s.getsockname()[1]}"), 1, "does not answer gRPC", "--http-port")
            assert time.monotonic() - t0 < 30
        finally:
            stop.set()
            thread.join()


@pytest.fixture
def loading_port():
    """The server's own port as it is while its model loads (server.gate.open_port: health NOT_SERVING, every other
    RPC UNAVAILABLE): (port, close) where close() stops listening, as a server that died while loading."""
    from logitserve.server.config import ServerConfig
    from logitserve.server.gate import open_port

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    listening = asyncio.run_coroutine_threadsafe(open_port(ServerConfig(port=0)), loop).result(30)
    closed = []

    def close():
        if not closed:
            closed.append(True)
            asyncio.run_coroutine_threadsafe(listening.close(), loop).result(30)
    yield listening.port, close
    close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


@pytest.mark.live_server
def test_a_loading_server_is_waited_for_saying_so_and_a_dead_one_is_said(loading_port):
    port, close = loading_port
    t0 = time.monotonic()
    run = _run("info", f"127.0.0.1:{port}", "--wait", "2")
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    waiting, failed = run.stderr.strip().splitlines()
    assert waiting.startswith("logitserve: ") and "not serving yet (health NOT_SERVING" in waiting and "--wait" in waiting
    assert failed.startswith("logitserve: ") and "was not serving within 2 s" in failed
    assert 2 <= time.monotonic() - t0 < 30
    _one_line(_run("info", f"127.0.0.1:{port}", "--wait", "0"), 1, "not serving yet", "--wait S")
    proc = subprocess.Popen([*CLI, "info", f"127.0.0.1:{port}", "--wait", "120"], stderr=subprocess.PIPE, text=True)
    assert "waiting up to 120 s" in proc.stderr.readline()
    close()                                      # the server died while loading: said at once, not after 120 s
    err = proc.stderr.read()
    assert proc.wait(30) == 1 and f"nothing listens on 127.0.0.1:{port}" in err, err


@pytest.mark.live_server
def test_output_into_a_closed_pipe_is_quiet(demo_cli_server):
    """`logitserve info HOST | head -2` ended in BrokenPipeError."""
    proc = subprocess.Popen([*CLI, "info", demo_cli_server.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                          # the reader is gone before the first line
    err = proc.stderr.read().decode()
    assert proc.wait(60) == 141 and err == "", err
    run = subprocess.run(f"{' '.join(CLI)} info {demo_cli_server.address} | head -2", shell=True, capture_output=True,
                         text=True, timeout=60)
    assert len(run.stdout.splitlines()) == 2 and run.stderr == "", run.stderr


@pytest.mark.live_server
@pytest.mark.xfail(strict=True, reason="needs the start-up restructure")
def test_ctrl_c_while_loading_says_so_and_exits_130(tmp_path):
    """What must happen (server/app.py's start-up): SIGINT after `logitserve: loading on ...` and before `serving`
    stops the start within 30 s, exit code 130 (128 + SIGINT, as a shell reports Ctrl-C), the last stderr line
    exactly `logitserve: interrupted while loading; exiting without serving`, and `serving` never printed. Today
    loading runs on and the process exits 0 without a word."""
    proc = subprocess.Popen([*CLI, "serve", "--port", "0", "--demo-shape", "body", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**ENV, "LOGITSERVE_CACHE": str(tmp_path)})     # the demo is built, then loaded
    try:
        line = proc.stdout.readline()
        assert line.startswith("logitserve: loading on"), line
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 30
    assert "serving" not in out and proc.returncode == 130, (proc.returncode, out, err)
    assert err.strip().splitlines()[-1] == "logitserve: interrupted while loading; exiting without serving", err


GROUPS = ("model", "parallel layout", "batching and memory", "network and HTTP", "security", "limits",
          "observability")


@pytest.mark.unit
def test_serve_help_is_grouped_by_task_one_screen_each_with_one_default_and_a_unit_per_flag():
    """`serve --help` was 248 lines, 67 flags in one list, defaults printed twice, flags without help or unit."""
    import argparse

    from logitserve.server.cli import build_parser

    text = _run("serve", "--help").stdout
    sections = re.split(r"^(\S[^\n]*):\n", text, flags=re.M)
    by_title = dict(zip(sections[1::2], sections[2::2]))
    assert [t for t in by_title if t != "options"] == list(GROUPS), list(by_title)
    for title in GROUPS:
        assert len(by_title[title].strip("\n").splitlines()) <= 40, title       # one screen: 40 lines of 100 columns
    assert len(text.splitlines()[0]) < 60                                      # a usage line, not 30 of them
    serve = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    flags = [a for a in serve._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    assert len(flags) >= 60
    grouped = {a.dest for g in serve._action_groups if g.title in GROUPS for a in g._group_actions}
    units = {"S", "MS", "SIZE", "N", "TOKENS", "ROWS", "PORT", "ADDRESS", "DIR", "FILE", "NAME", "TOKEN"}
    for a in flags:
        assert a.dest in grouped, f"{a.option_strings[0]} is in no group"
        assert a.help and len(a.help) > 10, f"{a.option_strings[0]} has no help"
        assert a.nargs == 0 or a.choices or a.metavar in units, (a.option_strings[0], a.metavar)
    for line in re.split(r"\n(?=  --)", text):
        assert line.count("default") <= 1, line


@pytest.mark.unit
def test_clients_waiting_for_a_server_say_what_they_wait_for(caplog):
    """TeacherPool(..., wait_ready=600) against addresses where nothing listens hung silently for up to 600 s."""
    import logging

    from logitserve.client import LogitServeError, TeacherClient, TeacherPool

    a, b = f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"
    with caplog.at_level(logging.WARNING, logger="logitserve.client"):
        with pytest.raises(LogitServeError, match="not ready within 2 s"):
            TeacherClient(a, wait_ready=2)
        with pytest.raises(LogitServeError, match="not ready within 2 s"):
            TeacherPool([a, b], wait_ready=2)
    said = [r.getMessage() for r in caplog.records if r.name == "logitserve.client"]
    for address in (a, b):
        assert any(m.startswith(f"waiting for {address} to answer") and "at most 2 s" in m for m in said), said
