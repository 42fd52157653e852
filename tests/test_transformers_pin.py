"""The server under the transformers that vLLM pins (0.33: transformers 5.20.2), in a fresh environment beside
ours: the cases where 5.20 differs from the newest (tied embeddings' TP plan, Gemma 2's default attention,
GPT-NeoX's plan) against float64 transformers of that same version. About a minute."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from helpers import copy_venv, pip_install, python_of

pytestmark = pytest.mark.fresh_venv

ROOT = Path(__file__).parent.parent
PIN = "transformers==5.20.2"
# Where 5.20 differs: Gemma 2 unpacked (its default attention), packed, at tp 2 and in two stages of tp 2 each;
# tied Llama and GPT-NeoX at tp 2 (their TP plans)
CASES = [f"tests/test_architectures.py::{case}" for case in (
    "test_softcapped_attention_unpacked[1]", "test_tp1_equals_reference[gemma2]",
    "test_tp2_sharded_equals_reference[gemma2]", "test_pp2_stages_equal_reference[gemma2-2]",
    "test_tp2_sharded_equals_reference[llama-tied]", "test_tp2_sharded_equals_reference[gpt_neox]")]


def test_architectures_under_vllms_transformers(server_venv, tmp_path):
    env = copy_venv(server_venv, tmp_path / "venv")      # logitserve[server] installed, then vLLM's pin over it
    python = python_of(env)
    pip_install(env, PIN, "pytest>=8", "psutil>=5.9", "hypothesis>=6")
    version = subprocess.run([python, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == PIN.split("==")[1]
    run = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CASES], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{len(CASES)} passed" in run.stdout, run.stdout[-1000:]
