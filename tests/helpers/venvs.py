"""Fresh virtual environments for the fresh_venv tier: torch installed once per session, copied per test.

A copy is `cp -al` (hard links, under a second): pip never writes into an installed file (it unlinks before
writing, and moves a package away before replacing it), and Python writes bytecode by rename, so installing
into one copy leaves the base and the other copies as they were."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent
TORCH = "torch==2.13.0"


def make_venv(path: Path, *requirements: str) -> Path:
    """A new venv at `path` with `requirements` installed in one resolve (none: bare)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=120)
    if requirements:
        pip_install(path, *requirements)
    return path


def pip_install(venv: Path, *requirements: str) -> None:
    subprocess.run([python_of(venv), "-m", "pip", "install", "-q", *requirements], check=True, timeout=600)


def copy_venv(base: Path, path: Path) -> Path:
    """`base` as a new venv at `path` (its own sys.prefix; scripts are run as `python -m`)."""
    subprocess.run(["cp", "-al", str(base), str(path)], check=True, timeout=120)
    return path


def python_of(venv: Path) -> str:
    return str(venv / "bin" / "python")
