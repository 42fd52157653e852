"""The client imports and works in a process where torch (and the server) cannot be imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import numpy as np

from helpers import ref_token_logprobs

pytestmark = pytest.mark.live_server

SCRIPT = r"""
import json, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers") or name.startswith("logitserve.server"):
            raise ImportError("blocked for this test: " + name)
sys.meta_path.insert(0, Block())
from logitserve.client import TeacherClient
with TeacherClient(sys.argv[1]) as c:
    lp = c.logprobs([[5, 9, 77, 300]])[0]
    vals, ids = c.topk([[5, 9]], 3, dtype="bf16")
    info = c.model_info()
bad = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers") or m.startswith("logitserve.server")]
print(json.dumps({"lp": lp.tolist(), "ids": ids[0].tolist(), "vals": vals[0].tolist(), "bad": bad,
                  "vocab": info.vocab_size}))
"""


def test_client_works_with_torch_unimportable(llama_server, llama_ref):
    out = subprocess.run([sys.executable, "-c", SCRIPT, llama_server.address], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONNOUSERSITE": "1"})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["bad"] == []
    seq = [5, 9, 77, 300]
    np.testing.assert_allclose(got["lp"], ref_token_logprobs(llama_ref.logits(seq), seq), atol=1e-5)
    assert len(got["ids"]) == 2 and len(got["ids"][0]) == 3 and got["vocab"] == 1003
