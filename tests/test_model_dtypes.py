"""bf16 / fp16 models: the model runs in its dtype, every reduction in fp32 (SPEC.md), against transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import random_seqs
from logitserve.client import TeacherClient

pytestmark = pytest.mark.live_server


@pytest.mark.parametrize("dtype,torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_half_precision_model_outputs_follow_its_own_logits(model_dirs, dtype, torch_dtype):
    import transformers as tf

    from helpers import ServerThread
    from logitserve.engine import EngineConfig
    from logitserve.loading import load_model
    from logitserve.server.config import ServerConfig

    directory = model_dirs["llama"]
    server = ServerThread(load_model(directory, dtype=dtype), ServerConfig(port=0, engine=EngineConfig(chunk_size=16)))
    ref_model = tf.AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).eval()
    seqs = random_seqs(np.random.default_rng(51), [5, 40])
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            r = c.forward(seqs, temperature=0.7, logprobs=True, topk=5, full_logits=True)
    finally:
        server.stop()
    assert info.dtype == dtype
    for seq, lp, tv, fl in zip(seqs, r.logprobs, r.topk_values, r.full_logits):
        with torch.no_grad():
            z = ref_model(torch.as_tensor(seq)[None]).logits[0]          # [L, V] in the model's dtype
        z64 = z.double() / 0.7                                            # the reductions' reference in float64
        want_lp = torch.zeros(len(seq), dtype=torch.float64)
        want_lp[1:] = torch.log_softmax(z64, -1)[:-1].gather(-1, torch.as_tensor(seq[1:])[:, None])[:, 0]
        np.testing.assert_allclose(lp, want_lp.numpy(), atol=1e-5, rtol=0)
        np.testing.assert_allclose(fl, (z.float() / 0.7).numpy(), atol=0, rtol=0)   # fp32 division of the model's logits
        np.testing.assert_allclose(tv, torch.sort(z64, -1, descending=True).values[:, :5].numpy(), atol=1e-5, rtol=0)
