"""Sharded loading: each TP rank's peak RSS while loading (VmHWM) against loading the whole checkpoint, and the
layouts refused at start-up, naming the dimension."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from helpers import CliServer, build_model

pytestmark = pytest.mark.multi_process


def _prelude():
    """Both loaders' imports, the model class included, are in the baseline, as in a server."""
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    from logitserve import loading  # noqa: F401
    from logitserve.hostmem import peak_rss_mib
    return peak_rss_mib()


def _whole(directory: str, out) -> None:
    before = _prelude()
    from logitserve.loading import load_model
    from logitserve.hostmem import peak_rss_mib

    loaded = load_model(directory)
    touched = sum(float(p.sum()) for p in loaded.model.parameters())   # mmap-backed weights count once read
    out.put(("whole", 0, peak_rss_mib() - before, touched))


def _rank(rank: int, port: int, directory: str, out, pp: int = 1) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    before = _prelude()
    from logitserve.hostmem import peak_rss_mib
    from logitserve.loading import load_sharded

    if pp == 1:
        loaded, shard = load_sharded(directory, "fp32", torch.device("cpu"), rank, 2, dist.group.WORLD)
    else:                 # stage `rank` of pp 2: only its layers (and the embedding or the norm and head)
        loaded, shard = load_sharded(directory, "fp32", torch.device("cpu"), 0, 1, None, pp=pp, stage=rank)
    touched = sum(float(p.sum()) for p in loaded.model.parameters())
    out.put(("tp2" if pp == 1 else "pp2", rank, peak_rss_mib() - before, touched))
    dist.destroy_process_group()


@pytest.mark.parametrize("pp,fp8", [(1, False), (2, False), (1, True)], ids=["tp2", "pp2", "tp2-fp8"])
def test_each_tp2_rank_peaks_under_six_tenths_of_the_whole_checkpoint(tmp_path, pp, fp8):
    """fp8: the same model as a 128x128 block-FP8 checkpoint, dequantized to fp32 as it is read: a rank reads its
    FP8 slices and their scales, never the whole model in host memory."""
    # body-heavy: 12 layers of hidden 640 / intermediate 1280 (175 MB fp32) beside 2.4 MB embeddings
    directory = tmp_path / "body"
    build_model(directory, "llama", vocab=1000, hidden=640, layers=12)
    import json

    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["intermediate_size"] == 1280
    if fp8:
        from helpers import quantize_dir

        directory, _ = quantize_dir(directory, tmp_path / "fp8", tmp_path / "dequantized", "block", (128, 128))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_whole, args=(str(directory), out))
    p.start()
    whole = out.get(timeout=180)
    p.join(60)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, str(directory), out, pp)) for r in range(2)]
    for q in procs:
        q.start()
    ranks = [out.get(timeout=180) for _ in procs]
    for q in procs:
        q.join(60)
        assert q.exitcode == 0
    # the model as served (fp32): an FP8 checkpoint is a quarter of it on disk, the dequantized one all of it
    served = tmp_path / "dequantized" if fp8 else directory
    checkpoint_mib = sum(f.stat().st_size for f in served.glob("*.safetensors")) / 2**20
    assert whole[2] >= 0.9 * checkpoint_mib, (whole, checkpoint_mib)       # the baseline really holds it all
    for label, rank, peak, _ in ranks:
        print(f"\n{label} rank {rank}: peak RSS while loading {peak:.0f} MiB = {peak / whole[2]:.2f} x the whole "
              f"load's {whole[2]:.0f} MiB")
        assert peak <= 0.6 * whole[2], f"rank {rank} peaked at {peak:.0f} MiB, whole load {whole[2]:.0f} MiB"


def test_layouts_that_cannot_split_are_refused_naming_the_dimension():
    import transformers as tf

    from logitserve.tp_plan import check_layout, resolve_plan

    cfg = tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024, hidden_size=256)
    check_layout(cfg, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2 does not divide by --tp 4"):
        check_layout(cfg, 4)
    with pytest.raises(ValueError, match=r"intermediate_size=1004 does not divide by --tp 8"):
        check_layout(tf.LlamaConfig(num_attention_heads=8, num_key_value_heads=8, intermediate_size=1004), 8)
    moe = tf.Qwen3MoeConfig(num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                            moe_intermediate_size=30)
    with pytest.raises(ValueError, match=r"moe_intermediate_size=30 does not divide by --tp 4"):
        check_layout(moe, 4)
    assert resolve_plan(cfg).source == "transformers"
    with pytest.raises(ValueError, match=r"model_type 'gpt2' has no TP plan"):
        resolve_plan(tf.GPT2Config())


def test_server_refuses_a_tp_the_kv_heads_do_not_divide_at_startup(tmp_path):
    directory = build_model(tmp_path / "kv2", "llama", hidden=64)     # 4 heads, 2 KV heads
    with pytest.raises(RuntimeError, match=r"num_key_value_heads=2 does not divide by --tp 4"):
        CliServer("--model", str(directory), "--tp", "4")


def test_server_refuses_pipelines_it_cannot_build_at_startup(tmp_path):
    """--pp with --cp (not supported, and why) and more stages than decoder layers: refused naming the flag, before
    or while the ranks start, never a hang. (Reward models are served under --pp: tests/test_reward_kinds.py.)"""
    directory = build_model(tmp_path / "two", "llama", hidden=64)      # 2 decoder layers
    with pytest.raises(RuntimeError, match=r"--pp 2 with --cp 2: not supported"):
        CliServer("--model", str(directory), "--pp", "2", "--cp", "2")
    with pytest.raises(RuntimeError, match=r"--pp 3: config.num_hidden_layers=2"):
        CliServer("--model", str(directory), "--pp", "3")


def _serve_logprobs(directory, seqs) -> list:
    """Token logprobs from an Engine on load_model (one process, the sharded loader with trivial groups)."""
    import numpy as np

    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model
    from logitserve.spec import Job, LogprobsOpts, OutputKind

    loaded = load_model(directory)
    job = Job(tuple(np.asarray(s, np.int32) for s in seqs), logprobs=LogprobsOpts())
    out = [np.full(len(s), np.nan) for s in seqs]
    for piece in Engine(loaded, EngineConfig(chunk_size=16)).run(job):
        if piece.output is OutputKind.TOKEN_LOGPROBS:
            out[piece.sequence][piece.offset[0] : piece.offset[0] + len(piece.tensor)] = piece.tensor.numpy()
    return loaded, out


def test_one_process_load_keeps_an_lm_head_bias_and_one_tied_embedding(tmp_path):
    """tp = 1 through the sharded loader: Phi's lm_head bias is read (logprobs equal float64 transformers), and a
    tied head is the embedding's own tensor, not a second copy."""
    import numpy as np
    import transformers as tf

    from helpers import Reference, ref_token_logprobs

    cfg = tf.PhiConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = tf.PhiForCausalLM(cfg).float().eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1.0)                     # a bias that moves the logprobs
    model.save_pretrained(tmp_path / "phi")
    seqs = [list(np.random.default_rng(6).integers(0, 300, n)) for n in (9, 30)]
    loaded, got = _serve_logprobs(tmp_path / "phi", seqs)
    assert loaded.head.bias is not None
    ref = Reference(tmp_path / "phi")
    for seq, lp in zip(seqs, got):
        np.testing.assert_allclose(lp, ref_token_logprobs(ref.logits(seq), seq), atol=1e-5, rtol=0)

    import json

    tied = build_model(tmp_path / "tied", "llama", hidden=64)
    config = tied / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "tie_word_embeddings": True}))
    loaded, _ = _serve_logprobs(tied, seqs[:1])
    assert loaded.head.weight.data_ptr() == loaded.model.get_input_embeddings().weight.data_ptr()
