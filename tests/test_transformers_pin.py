"""The server under the transformers that vLLM pins (0.33: transformers 5.20.2), in a fresh environment beside
ours: the cases where 5.20 differs from the newest (tied embeddings' TP plan, Gemma 2's default attention,
GPT-NeoX's plan) against float64 transformers of that same version. About two minutes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.fresh_venv

ROOT = Path(__file__).parent.parent
PIN = "transformers==5.20.2"
# 8 tests: Gemma 2 unpacked, packed, at tp 2 and in two pipeline stages (alone and with tp 2), tied Llama and GPT-NeoX at tp 2
CASES = "softcapped or gemma2 or (tp2_sharded and (llama-tied or gpt_neox))"


def test_architectures_under_vllms_transformers(tmp_path):
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    python = str(env / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True, timeout=600)
    subprocess.run(pip + [f"{ROOT}[server]", PIN, "pytest>=8", "psutil>=5.9", "hypothesis>=6"], check=True,
                   timeout=600)
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == PIN.split("==")[1]
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_architectures.py",
                          "-k", CASES], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "8 passed" in run.stdout, run.stdout[-1000:]
