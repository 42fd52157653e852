"""Causal LMs whose logits are more than a linear head (Gemma-2 softcapping, Cohere logit_scale, Granite
logits_scaling): every output against float64 transformers, and Granite at TP 2 (vocab-sharded logits)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import CliServer, Reference, build_transformed_head, check_every_output, random_seqs, serve_dir

V = 1003


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {arch: build_transformed_head(root / arch, arch) for arch in ("gemma2", "cohere", "granite")}


@pytest.mark.live_server
@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_transformed_heads_equal_reference(dirs, arch):
    ref = Reference(dirs[arch])
    with torch.no_grad():     # the transform changes the logits: a test that ignored it would fail
        plain = ref.model.lm_head(ref.model.model(torch.arange(1, 9)[None]).last_hidden_state)[0]
        assert not torch.allclose(plain, ref.logits(np.arange(1, 9)), atol=1e-3)
    server = serve_dir(dirs[arch], chunk_size=16)
    try:
        check_every_output(server.address, ref, random_seqs(np.random.default_rng(82), [1, 6, 40, 19], vocab=V))
    finally:
        server.stop()


@pytest.mark.multi_process
def test_granite_logits_scaling_under_tp2(dirs):
    ref = Reference(dirs["granite"])
    server = CliServer("--model", str(dirs["granite"]), "--tp", "2", "--logprob-chunk-size", "16")
    try:
        check_every_output(server.address, ref, random_seqs(np.random.default_rng(83), [1, 6, 40, 19], vocab=V))
    finally:
        assert server.stop() == 0
