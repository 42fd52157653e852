"""Reward scores from sequence-classification models, against plain transformers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import Reference, random_seqs, serve_dir
from logitserve.client import LogitServeError, TeacherClient

pytestmark = pytest.mark.live_server


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reward_scores_match_reference(reward_dirs, arch):
    ref = Reference(reward_dirs[arch])
    server = serve_dir(reward_dirs[arch])
    # ids from 1: the reference model looks for the last non-pad token and pad is 0.
    seqs = [s + 1 for s in random_seqs(np.random.default_rng(11), [1, 7, 40, 23], vocab=1000)]
    try:
        with TeacherClient(server.address) as c:
            info = c.model_info()
            got = c.scores(seqs)
            with pytest.raises(LogitServeError) as e:
                c.logprobs(seqs)
    finally:
        server.stop()
    assert info.kind == "reward" and info.num_labels == 2
    assert e.value.code.name == "INVALID_ARGUMENT" and "scores only" in e.value.details
    for seq, score in zip(seqs, got):
        with torch.no_grad():
            want = ref.model(torch.as_tensor(seq)[None]).logits[0].numpy()
        assert score.shape == (2,) and score.dtype == np.float32
        np.testing.assert_allclose(score, want, atol=1e-5, rtol=0)
