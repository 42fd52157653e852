"""The `logitserve` command as a user runs it: serve, info, query, export-demo, graceful stop."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import CliServer
from logitserve.loading import content_hash


def _cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "logitserve.server.cli", *args], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.live_server
def test_info_reports_the_demo_model(demo_cli_server):
    out = _cli("info", demo_cli_server.address)
    assert "logitserve-demo-causal" in out and "LlamaForCausalLM" in out and "32000" in out
    assert "blake2b:" in out and "causal_lm" in out


@pytest.mark.live_server
def test_query_prints_a_table_of_logprobs_and_topk(demo_cli_server):
    out = _cli("query", demo_cli_server.address, "--ids", "1,5,9,200", "--topk", "3")
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [r[1] for r in rows] == ["1", "5", "9", "200"]
    assert [r[2] for r in rows] == ["'<s>'", "'t5'", "'t9'", "'t200'"]      # each token's text (Detokenize)
    assert float(rows[0][3]) == 0.0 and all(float(r[3]) < 0 for r in rows[1:])
    assert all(len(r) == 4 + 3 for r in rows)   # pos, token, text, logprob, 3 x id:logprob


@pytest.mark.live_server
def test_query_of_a_text_prints_the_ids_the_server_tokenized(demo_cli_server):
    out = _cli("query", demo_cli_server.address, "--text", "t5 t9 t200", "--topk", "2")
    rows = [line.split() for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert [int(r[1]) for r in rows] == [1, 5, 9, 200]          # the demo tokenizer adds BOS (id 1)
    assert float(rows[0][3]) == 0.0 and all(float(r[3]) < 0 for r in rows[1:])


@pytest.mark.live_server
def test_query_of_a_bad_id_prints_the_status_and_fails(demo_cli_server):
    out = subprocess.run([sys.executable, "-m", "logitserve.server.cli", "query", demo_cli_server.address,
                          "--ids", "1,99999"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "INVALID_ARGUMENT" in out.stderr and "sequences[0][1]" in out.stderr


@pytest.mark.live_server
def test_export_demo_is_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _cli("export-demo", str(a))
    _cli("export-demo", str(b))
    assert content_hash(a) == content_hash(b)
    assert (a / "tokenizer.json").exists() and (a / "config.json").exists()


@pytest.mark.live_server
def test_export_demo_writes_files_the_umask_allows_and_git_ignores_the_readmes_directory(tmp_path):
    """Issue 45: `export-demo ./my-model` (the README's, run in the checkout) wrote model.safetensors mode 0600, and
    git did not ignore it."""
    import os
    import stat
    from pathlib import Path

    run = subprocess.run(f"umask 022 && {sys.executable} -m logitserve.server.cli export-demo {tmp_path / 'm'}",
                         shell=True, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "Writing model shards" not in run.stderr, run.stderr     # no progress bar either
    modes = {f.name: stat.S_IMODE(os.stat(f).st_mode) for f in (tmp_path / "m").iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    root = Path(__file__).parent.parent
    for path in ("my-model/model.safetensors", "my-reward-model/config.json", "tokens.txt", "captured/shard-0.parquet"):
        ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=root, timeout=30)
        assert ignored.returncode == 0, f"{path} is not ignored by git"


@pytest.mark.live_server
def test_reward_demo_serves_scores_and_stops_cleanly_on_sigterm():
    from logitserve.client import TeacherClient

    server = CliServer("--demo", "reward")
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            scores = c.scores([[1, 2, 3], [4, 5]])
    finally:
        code = server.stop()
    assert info.kind == "reward" and info.name == "logitserve-demo-reward"
    assert [s.shape for s in scores] == [(1,), (1,)]
    assert code == 0


@pytest.mark.fresh_venv
def test_serve_without_the_server_extras_says_what_to_install():
    code = ("import importlib.util, sys; real = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda name, *a: None if name in ('torch', 'grpc_health') else real(name, *a)\n"
            "from logitserve.server.cli import main; sys.exit(main(['serve']))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "missing here: torch, grpc_health" in run.stderr and "pip install 'logitserve[server]'" in run.stderr
