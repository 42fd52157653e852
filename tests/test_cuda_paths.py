"""The CUDA paths' CPU-testable parts: a request that runs out of memory alone gets RESOURCE_EXHAUSTED (the others
are served), varlen_attn's arguments chosen by probing the installed torch, the capability probe itself."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import ServerThread, assert_close, random_seqs, ref_token_logprobs
from logitserve.client import LogitServeError, TeacherClient


@pytest.mark.live_server
def test_a_request_that_runs_out_of_memory_alone_gets_resource_exhausted(model_dirs):
    """A simulated allocator failure on any sequence of 300+ tokens: the batch is redone per job, that job's
    request ends RESOURCE_EXHAUSTED naming memory, the others in its batch are served exactly, the server stays."""
    from logitserve.engine import Engine, EngineConfig
    from logitserve.loading import load_model
    from logitserve.server.config import SchedulerConfig, ServerConfig
    from logitserve.server.scheduler import engine_batch_runner
    from helpers import Reference

    loaded = load_model(model_dirs["llama"])
    engine = Engine(loaded, EngineConfig(chunk_size=16))
    real = engine.packed_hidden

    def packed_hidden(ids, lengths, *args, **kw):
        if max(lengths) >= 300:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real(ids, lengths, *args, **kw)

    real_one = engine.hidden

    def hidden(ids, *args, **kw):           # the per-sequence redo
        if len(ids) >= 300:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real_one(ids, *args, **kw)

    engine.packed_hidden, engine.hidden = packed_hidden, hidden
    server = ServerThread(loaded, ServerConfig(port=0, scheduler=SchedulerConfig(batch_delay_s=0.2)),
                          run_batch=engine_batch_runner(engine.batch_steps))
    try:
        ref = Reference(model_dirs["llama"])
        small = random_seqs(np.random.default_rng(3), [20, 33])
        big = random_seqs(np.random.default_rng(4), [310])
        import threading

        results = {}

        def call(name, seqs):
            with TeacherClient(server.address) as c:
                try:
                    results[name] = c.logprobs(seqs)
                except LogitServeError as e:
                    results[name] = e

        threads = [threading.Thread(target=call, args=a) for a in (("big", big), ("small", small))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        err = results["big"]
        assert isinstance(err, LogitServeError) and err.code.name == "RESOURCE_EXHAUSTED", err
        assert "memory" in str(err) and "simulated" in str(err)
        for seq, lp in zip(small, results["small"]):
            assert_close(lp, ref_token_logprobs(ref.logits(seq), seq))
        with TeacherClient(server.address) as c:                        # and it keeps serving
            assert len(c.logprobs(small)) == 2
    finally:
        server.stop()


def _fake_varlen(signature: str):
    """A varlen_attn stand-in with one of the signatures torch has had; it records its keyword arguments."""
    calls = []
    namespace = {}
    exec(f"def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, {signature}):\n"
         f"    calls.append(dict(locals()))\n"
         f"    return q", {"calls": calls}, namespace)
    return namespace["varlen_attn"], calls


@pytest.mark.unit
@pytest.mark.parametrize("signature,window,gqa,expect", [
    ("scale=None, window_size=(-1, -1), enable_gqa=False", None, True,
     {"window_size": (-1, 0), "enable_gqa": True}),
    ("scale=None, window_size=(-1, -1)", None, True, {"window_size": (-1, 0)}),       # KV heads repeated
    ("scale=None, window_size=(-1, -1)", 128, False, {"window_size": (127, 0)}),
    ("scale=None, is_causal=False", None, False, {"is_causal": True}),
    ("scale=None, is_causal=False", 128, False, NotImplementedError),              # no window: the sdpa path
    ("scale=None", None, False, NotImplementedError),                                # no causal mask at all
])
def test_varlen_arguments_follow_the_installed_signature(monkeypatch, signature, window, gqa, expect):
    import torch.nn.attention.varlen as varlen_mod

    from logitserve import attention
    from logitserve.capabilities import probe

    fake, calls = _fake_varlen(signature)
    monkeypatch.setattr(varlen_mod, "varlen_attn", fake)
    caps = probe.__wrapped__("cpu")              # probed afresh (not the cached probe): the fake's signature
    heads_kv = 2 if gqa else 4
    q, k = torch.zeros(1, 4, 6, 8), torch.zeros(1, heads_kv, 6, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    if expect is NotImplementedError:
        with pytest.raises(NotImplementedError):
            attention._flash_varlen(q, k, k, cu, 6, 0.5, window, caps)
        return
    attention._flash_varlen(q, k, k, cu, 6, 0.5, window, caps)
    got = {n: calls[0][n] for n in ("window_size", "enable_gqa", "is_causal") if n in calls[0]}
    want = {n: v for n, v in {"window_size": (-1, -1), "enable_gqa": False, "is_causal": False}.items()
            if n in calls[0]}
    want.update(expect)
    assert got == want and calls[0]["scale"] == 0.5
    assert calls[0]["k"].shape[1] == (heads_kv if expect.get("enable_gqa") else 4)   # grouped, or repeated


@pytest.mark.unit
def test_capability_probe_on_cpu():
    from logitserve.capabilities import probe

    caps = probe("cpu")
    assert caps.torch == torch.__version__ and not caps.cuda and not caps.mm_out_dtype
    assert caps.varlen_gqa == ("enable_gqa" in __import__("inspect").signature(
        __import__("torch.nn.attention.varlen", fromlist=["varlen_attn"]).varlen_attn).parameters)


@pytest.mark.unit
def test_versions_below_the_floor_are_refused_in_one_line():
    from logitserve.preflight import StartupError, check_versions

    check_versions()                                                   # what CI has passes
    check_versions({"torch": "2.11.0+cu130", "transformers": "5.20.2"})
    for installed, name in (({"torch": "2.11.0+cu130", "transformers": "5.17.0"}, "transformers >= 5.20"),
                            ({"torch": "2.10.1", "transformers": "5.25.0"}, "torch >= 2.11")):
        try:
            check_versions(installed)
        except StartupError as e:
            assert name in str(e) and "\n" not in str(e)
        else:
            raise AssertionError(installed)


@pytest.mark.multi_process
def test_nccl_options_make_timeouts_raise(monkeypatch):
    from logitserve.parallel import nccl_options

    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")              # a user's own setting is kept
    kw = nccl_options(torch.device("cuda", 0))
    import os

    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    import inspect

    import torch.distributed as dist

    assert ("device_id" in kw) == ("device_id" in inspect.signature(dist.init_process_group).parameters)


@pytest.mark.unit
def test_a_gpu_server_gets_a_memory_budget_from_the_free_device_memory():
    from logitserve.server.budget import device_budget
    from logitserve.server.config import SchedulerConfig, ServerConfig

    config = ServerConfig()
    got = device_budget(config, torch.device("cuda", 0), free_bytes=100 << 30)
    assert got.scheduler.memory_budget_bytes == int(0.9 * (100 << 30))
    assert device_budget(config, torch.device("cpu")) is config                         # CPU: unchanged
    given = ServerConfig(scheduler=SchedulerConfig(memory_budget_bytes=1 << 30))
    assert device_budget(given, torch.device("cuda", 0), free_bytes=100 << 30) is given   # the flag wins
