"""Token logprobs never materialize [L, V]: the server's peak RSS stays far below a plain forward's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import numpy as np

from logitserve.client import TeacherClient

pytestmark = pytest.mark.live_server

L = 8192
GIB = 1 << 30

PLAIN = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from logitserve.demo import demo_dir
model = AutoModelForCausalLM.from_pretrained(demo_dir("causal"), dtype=torch.float32).eval()
ids = torch.as_tensor([int(x) for x in sys.argv[1].split(",")])[None]
with torch.no_grad():
    logits = model(ids).logits          # [1, 8192, 32000] fp32: 1 GiB
print(dict(l.split(":") for l in open("/proc/self/status") if l.startswith("VmHWM"))["VmHWM"].strip())
"""


def _vm_hwm_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("VmHWM"))
    return int(line.split()[1])


def _vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(x for x in f if x.startswith("VmRSS")).split()[1])


def test_logprobs_peak_rss_is_0_7_gib_below_a_plain_forward(demo_cli_server):
    from logitserve.demo import demo_dir
    from logitserve.loading import load_model
    from logitserve.server.app import memory_estimator
    from logitserve.server.config import ServerConfig
    from logitserve.engine import Engine, EngineConfig
    from logitserve.spec import Job, LogprobsOpts

    seq = np.random.default_rng(0).integers(0, 32000, L)
    before = _vm_rss_kib(demo_cli_server.proc.pid) * 1024
    with TeacherClient(demo_cli_server.address) as c:
        lp = c.logprobs([seq])[0]
    server_peak = _vm_hwm_kib(demo_cli_server.proc.pid) * 1024
    loaded = load_model(demo_dir("causal"))
    pack = Engine(loaded, EngineConfig(512)).pack_tokens       # the CLI server's default: packed
    estimator = memory_estimator(loaded, ServerConfig(engine=EngineConfig(512)), 32000, pack_tokens=pack)
    estimate = estimator(Job(sequences=(seq.astype(np.int32),), logprobs=LogprobsOpts()))
    print(f"\nrequest's extra memory: measured <= {(server_peak - before) / 2**20:.0f} MiB, "
          f"estimated {estimate / 2**20:.0f} MiB")
    assert estimate >= server_peak - before, "the admission estimate must not undercount"
    # full packed bodies: 32 x 512 tokens in one request
    many = [np.random.default_rng(i).integers(0, 32000, 512) for i in range(32)]
    with TeacherClient(demo_cli_server.address) as c:
        assert len(c.logprobs(many)) == 32
    packed_peak = _vm_hwm_kib(demo_cli_server.proc.pid) * 1024
    packed_estimate = estimator(Job(sequences=tuple(s.astype(np.int32) for s in many), logprobs=LogprobsOpts()))
    print(f"packed 32 x 512: measured <= {(packed_peak - before) / 2**20:.0f} MiB, "
          f"estimated {packed_estimate / 2**20:.0f} MiB")
    assert packed_estimate >= packed_peak - before
    out = subprocess.run([sys.executable, "-c", PLAIN, ",".join(map(str, seq))], capture_output=True, text=True,
                         timeout=600, env=os.environ.copy())
    assert out.returncode == 0, out.stderr
    plain_peak = int(out.stdout.split()[0]) * 1024
    print(f"\npeak RSS: logitserve server {server_peak / GIB:.2f} GiB, plain transformers forward "
          f"{plain_peak / GIB:.2f} GiB, saved {(plain_peak - server_peak) / GIB:.2f} GiB")
    assert lp.shape == (L,) and np.isfinite(lp).all() and lp[0] == 0
    assert plain_peak - server_peak >= 0.7 * GIB
