"""What the two set-up commands install: `make serve` what serving needs (torch and the server extra), `make test` the
test extra and Axolotl's loader besides; `pip check` clean after each; `make help` lists every target."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import python_of

pytestmark = pytest.mark.fresh_venv

ROOT = Path(__file__).parent.parent


def _make_n(target: str, tmp_path) -> str:
    """The commands `make TARGET` would run for a fresh virtual environment (none is made)."""
    run = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_make_serve_installs_what_serving_needs_and_make_test_the_rest(tmp_path):
    serve = _make_n("serve", tmp_path)
    assert "torch==2.13.0" in serve and re.search(r"pip install --quiet -e \"\.\[server\]\"", serve), serve
    assert "[test]" not in serve and "axolotl" not in serve, serve      # issue 45: pip check broke after make serve
    test = _make_n("install", tmp_path)
    assert '-e ".[test]"' in test and re.search(r"--no-deps .*--target \S+axolotl-no-deps \"axolotl==", test), test


def test_make_help_lists_every_target():
    run = subprocess.run(["make", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    phony = re.search(r"^\.PHONY: (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    listed = re.findall(r"^  make (\S+) +\S", run.stdout, re.M)
    assert listed and sorted(listed) == sorted(phony), run.stdout


def test_pip_check_is_clean_where_the_tests_run():
    """This environment is `make test`'s (CI's .venv): Axolotl's folder is outside site-packages, unseen by pip."""
    run = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_pip_check_is_clean_after_installing_the_server(server_venv):
    """server_venv is torch 2.13.0 then `pip install logitserve[server]` from this checkout: what `make serve` runs."""
    run = subprocess.run([python_of(server_venv), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
