"""A new user's first hour: client commands on a client-only install, start-up errors in one line, CLI polish."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from logitserve.client.cli import parse_ids, with_port

# What a client-only `pip install logitserve` lacks: the server extras (and the health-checking package).
BLOCKED = ("torch", "transformers", "safetensors", "grpc_health", "grpc_reflection", "prometheus_client", "accelerate")
CLIENT_ONLY = r"""
import sys
BLOCKED = %r
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("not installed (client-only test): " + name)
sys.meta_path.insert(0, Block())
import importlib.util
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] in BLOCKED else real(name, *a)
from logitserve.server.cli import main
code = main(sys.argv[1:])
bad = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("IMPORTED:", bad)
sys.exit(code)
""" % (BLOCKED,)


def _client_only(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLIENT_ONLY, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.fresh_venv
def test_client_commands_work_on_a_client_only_install(demo_cli_server):
    port = demo_cli_server.address.rsplit(":", 1)[1]
    health = _client_only("health", demo_cli_server.address)
    assert health.returncode == 0 and "SERVING" in health.stdout and "IMPORTED: []" in health.stdout, health.stderr
    info = _client_only("info", f"127.0.0.1:{port}")
    assert info.returncode == 0, info.stderr
    assert "vocab_size: 32000" in info.stdout and "IMPORTED: []" in info.stdout
    assert "ranks:" in info.stdout and "tp_plan_source: -" in info.stdout     # no empty value, ranks as rows
    query = _client_only("query", demo_cli_server.address, "--ids", "1 5 9", "--topk", "2")
    assert query.returncode == 0, query.stderr
    rows = [line.split() for line in query.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[1] for r in rows] == ["1", "5", "9"]
    serve = _client_only("serve")
    assert serve.returncode == 2 and "pip install torch==2.13.0 && pip install 'logitserve[server]'" in serve.stderr
    export = _client_only("export-demo", "/tmp/never")
    assert export.returncode == 2 and "pip install torch==2.13.0" in export.stderr


def _serve_fails(*args: str) -> subprocess.CompletedProcess:
    t0 = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--port", "0", *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stderr)
    assert "Traceback" not in run.stderr and 1 <= len(run.stderr.strip().splitlines()) <= 2, run.stderr
    assert time.monotonic() - t0 < 30         # before any model loads or rank starts
    return run


@pytest.mark.multi_process
def test_start_up_errors_are_one_line_each(tmp_path):
    assert "--model /nonexistent/x: no such directory" in _serve_fails("--model", "/nonexistent/x").stderr
    hub = _serve_fails("--model", "Qwen/Qwen3-8B").stderr
    assert "Serving is offline" in hub and "hf download Qwen/Qwen3-8B" in hub
    assert "no config.json in it" in _serve_fails("--model", str(tmp_path)).stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert "no weights (*.safetensors)" in _serve_fails("--model", str(tmp_path)).stderr
    layout = _serve_fails("--tp", "3").stderr
    assert "num_attention_heads=8 does not divide by --tp 3" in layout


@pytest.mark.live_server
def test_a_port_held_by_another_program_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "Traceback" not in run.stderr and "in use" in run.stderr, run.stderr


@pytest.mark.live_server
def test_cli_polish():
    assert with_port("localhost") == "localhost:50051" and with_port("10.0.0.1:7000") == "10.0.0.1:7000"
    assert with_port("[::1]") == "[::1]:50051" and with_port("dns:///teacher.svc:50051") == "dns:///teacher.svc:50051"
    assert parse_ids("1,5 9, 200") == [1, 5, 9, 200]
    with pytest.raises(ValueError, match="'x' is not a token id"):
        parse_ids("1 x")
    bad = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "query", "127.0.0.1:1", "--ids", "1 x",
                          "--wait", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "'x' is not a token id" in bad.stderr
    top = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "--help"], capture_output=True, text=True)
    for command in ("serve", "info", "query", "health", "capture", "export-demo"):
        assert f"    {command}" in top.stdout, top.stdout
    serve = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "serve", "--help"], capture_output=True,
                           text=True).stdout
    assert "--port PORT" in serve and "(default: 50051)" in serve and "(default: 30.0)" in serve
    query = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "query", "--help"], capture_output=True,
                           text=True).stdout
    for flag in ("--topk", "--temperature", "--token", "--token-file", "--tls-ca", "--tls-cert", "--tls-key"):
        assert flag in query
    assert "(default: 5)" in query and "LOGITSERVE_TOKEN" in query


@pytest.mark.live_server
def test_detokenize_spells_ids_as_the_models_tokenizer_does(demo_cli_server, model_dirs):
    from transformers import AutoTokenizer

    from logitserve.client import LogitServeError, TeacherClient
    from logitserve.demo import demo_dir

    ref = AutoTokenizer.from_pretrained(demo_dir("causal"), local_files_only=True)
    ids = [1, 5, 9, 200, 0, 31999]
    with TeacherClient(demo_cli_server.address) as c:
        d = c.detokenize(ids)
        with pytest.raises(LogitServeError) as bad:
            c.detokenize([3, 32000])
    assert list(d.tokens) == ref.convert_ids_to_tokens(ids)
    assert list(d.texts) == [ref.decode([x]) for x in ids] and d.unk_token_id == ref.unk_token_id == 0
    assert bad.value.code.name == "INVALID_ARGUMENT" and "ids[1]: 32000 is outside [0, 32000)" in bad.value.details
    from helpers import serve_dir

    bare = serve_dir(model_dirs["llama"])             # a directory without tokenizer files
    try:
        with TeacherClient(bare.address) as c, pytest.raises(LogitServeError) as none:
            c.detokenize([1])
        assert none.value.code.name == "FAILED_PRECONDITION"
    finally:
        bare.stop()


@pytest.mark.live_server
def test_query_shows_each_tokens_text_and_warns_about_unknown_words(demo_cli_server):
    run = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "query", demo_cli_server.address,
                          "--text", "t5 hello t9"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "warning: 1 of the text's" in run.stderr and "unknown token (id 0)" in run.stderr
    rows = [line.split() for line in run.stdout.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[2] for r in rows][-3:] == ["'t5'", "'<unk>'", "'t9'"], run.stdout


@pytest.mark.fresh_venv
def test_a_real_client_only_venv_runs_every_client_command(demo_cli_server, tmp_path):
    """`pip install logitserve` (no extras) in a fresh venv: health, info and query work; serve, export-demo and
    capture each say in one line which extra to install (torch pinned)."""
    from pathlib import Path

    root = Path(__file__).parent.parent
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True, timeout=120)
    python = str(env / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "-q", str(root)], check=True, timeout=600)
    cli = str(env / "bin" / "logitserve")
    missing = subprocess.run([python, "-c", "import torch"], capture_output=True)
    assert missing.returncode != 0                                  # really client-only

    def run(*args):
        return subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)

    assert "SERVING" in run("health", demo_cli_server.address).stdout
    assert "vocab_size: 32000" in run("info", demo_cli_server.address).stdout
    q = run("query", demo_cli_server.address, "--ids", "1 5 9")
    assert q.returncode == 0 and "'t5'" in q.stdout, q.stderr
    for args, needs in ((("serve",), "pip install torch==2.13.0 && pip install 'logitserve[server]'"),
                        (("export-demo", str(tmp_path / "d")), "pip install torch==2.13.0"),
                        (("capture", demo_cli_server.address, "--input", "x", "--out", str(tmp_path / "o")),
                         "pip install 'logitserve[capture]'")):
        r = run(*args)
        assert r.returncode == 2 and needs in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
