"""logitserve beside tritonclient[grpc] 2.73 (protobuf < 7) in one fresh environment: client and server import,
serve and answer (about a minute: it builds a venv with torch from the local index)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import CliServer

ROOT = Path(__file__).parent.parent


def test_client_and_server_work_beside_tritonclient(tmp_path):
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True, timeout=600)
    # one resolve, as a user adds logitserve to an environment that pins tritonclient
    subprocess.run(pip + ["tritonclient[grpc]==2.73.0", f"{ROOT}[server]"], check=True, timeout=600)
    python = str(env / "bin" / "python")
    server = CliServer("--logprob-chunk-size", "64", python=python)
    try:
        code = ("import google.protobuf as g, tritonclient.grpc, numpy as np\n"
                "from logitserve.client import TeacherClient\n"
                f"c = TeacherClient('{server.address}')\n"
                "lp = c.logprobs([[1, 5, 9, 200]])[0]\n"
                "assert lp.shape == (4,) and lp[0] == 0 and (lp[1:] < 0).all()\n"
                "print(g.__version__)\n")
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().startswith("6."), out.stdout          # tritonclient kept its protobuf
    finally:
        assert server.stop() == 0
