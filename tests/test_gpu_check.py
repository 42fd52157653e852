"""bench/gpu_check.sh cannot rot: its dry run (every step, on the CPU, from wheels for this Python) passes here,
and the wheels it carries to the lent GPU machine install into a clean --target for cp312 manylinux."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.fresh_venv
def test_gpu_check_dry_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in summary["steps"]}
    assert run.returncode == 0, (status, run.stdout[-3000:])
    assert summary["dry_run"] and not summary["failed"]
    assert status == {"install": "pass", "versions": "pass", "equality": "pass", "nccl": "skipped", "bf16": "pass",
                      "fp8": "pass", "flash": "skipped", "hidden": "pass", "load": "pass", "throughput": "pass",
                      "groups": "pass"}
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert '"capabilities"' in log and "bf16 vs fp32, 1x1" in log and "OK" in log
    assert "fp8 channel vs dequantized fp32: FP8 GEMMs ran" in log       # the FP8 step compared a real FP8 run
    assert "hidden: head on cpu (bf16 weights, server logits bf16): max |rebuilt - served|" in log
    assert "logitserve_from" in log and "/site/logitserve/" in log       # logitserve came from the wheel


@pytest.mark.fresh_venv
def test_gpu_wheels_install_for_cp312_manylinux(tmp_path):
    """The set `make gpu-wheels` carries: one version of each, and pip installs all of it into a clean --target
    with the lent image's platform (cp312, manylinux x86_64); the script checks that itself."""
    out = subprocess.run(["bash", "bench/gpu_wheels.sh", str(tmp_path / "whl"), "3.12"], cwd=ROOT,
                         env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    names = sorted(p.name for p in (tmp_path / "whl").iterdir())
    assert any(n.startswith("logitserve-") for n in names) and any("cp312" in n or "abi3" in n for n in names)
    for pkg in ("grpcio_health_checking", "grpcio_reflection", "starlette", "uvicorn", "orjson", "transformers"):
        assert any(n.lower().startswith(pkg) for n in names), (pkg, names)
    assert sum(p.stat().st_size for p in (tmp_path / "whl").iterdir()) < 48 << 20     # room in the 64 MiB carry
