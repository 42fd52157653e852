"""The examples against the served demo teacher, shortened: the loss falls and the plot is written.

distill_student.py: forward KL on the teacher's top-64. distill_cross_tokenizer.py: a byte-level student against
the word-level demo teacher through hidden states, the head and GOLD's byte alignment."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.live_server

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize("script,steps,timeout", [("distill_student.py", 40, 240),
                                                  ("distill_cross_tokenizer.py", 60, 300)])
def test_the_example_learns_from_the_served_teacher(demo_cli_server, tmp_path, script, steps, timeout):
    plot, losses = tmp_path / "curve.png", tmp_path / "losses.json"
    run = subprocess.run([sys.executable, str(EXAMPLES / script), "--teacher", demo_cli_server.address,
                          "--steps", str(steps), "--plot", str(plot), "--losses", str(losses)],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    curve = json.loads(losses.read_text())
    assert len(curve) == steps and np.mean(curve[-10:]) < 0.97 * np.mean(curve[:10])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
