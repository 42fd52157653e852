"""Sharded loading: each TP rank's peak RSS while loading (VmHWM) against loading the whole checkpoint, and the
layouts refused at start-up, naming the dimension."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import CliServer
from helpers import build_model


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


@pytest.mark.parametrize("pp", [1, 2], ids=["tp2", "pp2"])
def test_each_tp2_rank_peaks_under_six_tenths_of_the_whole_checkpoint(tmp_path, pp):
    # body-heavy: 12 layers of hidden 640 / intermediate 1280 (175 MB fp32) beside 2.4 MB embeddings
    directory = tmp_path / "body"
    build_model(directory, "llama", vocab=1000, hidden=640, layers=12)
    import json

    cfg = json.loads((directory / "config.json").read_text())
    assert cfg["intermediate_size"] == 1280
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
    checkpoint_mib = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 2**20
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
    """--pp with --cp (not supported, and why), more stages than decoder layers, and a reward model under --pp:
    refused naming the flag, before or while the ranks start, never a hang."""
    directory = build_model(tmp_path / "two", "llama", hidden=64)      # 2 decoder layers
    with pytest.raises(RuntimeError, match=r"--pp 2 with --cp 2: not supported"):
        CliServer("--model", str(directory), "--pp", "2", "--cp", "2")
    with pytest.raises(RuntimeError, match=r"--pp 3: config.num_hidden_layers=2"):
        CliServer("--model", str(directory), "--pp", "3")
    reward = build_model(tmp_path / "reward", "llama", kind="reward", hidden=64)
    with pytest.raises(RuntimeError, match=r"--pp serves causal LMs"):
        CliServer("--model", str(reward), "--pp", "2")
