"""examples/distill_student.py against the served demo teacher, shortened: the forward KL falls and the plot is
written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

EXAMPLE = Path(__file__).parent.parent / "examples" / "distill_student.py"


def test_the_student_example_learns_from_the_served_teacher(demo_cli_server, tmp_path):
    plot, losses = tmp_path / "curve.png", tmp_path / "losses.json"
    run = subprocess.run([sys.executable, str(EXAMPLE), "--teacher", demo_cli_server.address, "--steps", "40",
                          "--plot", str(plot), "--losses", str(losses)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    curve = json.loads(losses.read_text())
    assert len(curve) == 40 and np.mean(curve[-10:]) < 0.97 * np.mean(curve[:10])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CROSS = Path(__file__).parent.parent / "examples" / "distill_cross_tokenizer.py"


def test_the_cross_tokenizer_example_learns_through_hidden_states(demo_cli_server, tmp_path):
    """A byte-level student against the word-level demo teacher: hidden states + the head + GOLD alignment."""
    plot, losses = tmp_path / "curve.png", tmp_path / "losses.json"
    run = subprocess.run([sys.executable, str(CROSS), "--teacher", demo_cli_server.address, "--steps", "60",
                          "--plot", str(plot), "--losses", str(losses)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    curve = json.loads(losses.read_text())
    assert len(curve) == 60 and np.mean(curve[-10:]) < 0.97 * np.mean(curve[:10])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
