"""tp x cp servers through the real CLI, server and client, against one-process transformers in float64."""
from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import numpy as np
import psutil
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from helpers import (CliServer, Reference, TorchrunServer, assert_close, build_model, check_ranks,
                     random_seqs, ref_token_logprobs, separated)
from logitserve.client import LogitServeError, TeacherClient, Wanted

V = 32003                          # odd: the vocab shards are padded under tp = 2
LENGTHS = [1, 2, 7, 45, 130]       # none a multiple of 2 * cp beyond the trivial; crossing 16-row chunks
# bench/gpu_check.sh sets these to run the same checks with CUDA + NCCL on the layouts its GPUs fit.
# "TPxCP[xPP][@2nodes]": "2x1x2" is tp 2 x pp 2; "@2nodes" runs it as two torchrun agents of world / 2 ranks each
# (c10d rendezvous on localhost), as on two nodes.
def _layout(spec: str) -> tuple[int, int, int, str]:
    grid, _, where = spec.partition("@")
    dims = [int(x) for x in grid.split("x")] + [1]
    return dims[0], dims[1], dims[2], where


LAYOUTS = [_layout(spec) for spec in os.environ.get(
    "LOGITSERVE_TEST_LAYOUTS", "1x1,2x1,1x2,2x2,1x1x2,2x1x2,2x2@2nodes,2x1x2@2nodes").split(",")]
DEVICE = os.environ.get("LOGITSERVE_TEST_DEVICE", "cpu")


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    directory = build_model(tmp_path_factory.mktemp("tp") / "llama", "llama", vocab=V, hidden=64, max_pos=1024)
    return directory, Reference(directory)


@pytest.fixture(scope="module", params=LAYOUTS,
                ids=[f"tp{t}-cp{c}-pp{p}" + (f"-{w}" if w else "") for t, c, p, w in LAYOUTS])
def sharded(request, tp_model):
    tp, cp, pp, where = request.param
    directory, ref = tp_model
    args = ("--model", str(directory), "--tp", str(tp), "--cp", str(cp), "--pp", str(pp), "--logprob-chunk-size",
            "16", "--pp-microbatch-tokens", "64", "--device", DEVICE, "--http-port", "0")
    server = TorchrunServer(*args, nproc=tp * cp * pp // 2) if where == "2nodes" else CliServer(*args)
    yield tp, cp, server, ref, pp
    assert server.stop() == 0, "".join(server.log[-20:])


@pytest.mark.multi_process
def test_every_output_equals_one_process_reference(sharded):
    tp, cp, server, ref, pp = sharded
    rng = np.random.default_rng(21)
    seqs = random_seqs(rng, LENGTHS, vocab=V)
    cands = [rng.integers(0, V, (len(s), 6)) for s in seqs]
    with TeacherClient(server.address) as c:
        info = c.model_info()
        r = c.forward(seqs, temperature=0.9, logprobs=True, topk=10, candidates=cands, full_logits=True,
                      vocab_range=(15990, 16020), topk_tail=True, token_ranks=True, hidden_states=True)
        whole = c.full_logits(seqs[3:4], temperature=0.9)[0]
        every = c.forward(seqs[1:3], topk=V, topk_tail=True, topk_as_logprobs=True)     # k = V: no tail left
    world = tp * cp * pp
    assert (info.tp_size, info.cp_size, info.pp_size, info.world_size, len(info.ranks)) == (tp, cp, pp, world, world)
    assert sorted((x["tp_rank"], x["cp_rank"], x["pp_rank"]) for x in info.ranks) == sorted(
        (t, c, p) for t in range(tp) for c in range(cp) for p in range(pp))
    assert info.vocab_size == V
    # packed by default; under CP every sequence is spread over the ranks, so bodies run per sequence
    assert info.batching == r.batching == ("exact" if cp > 1 else "packed")
    for j, seq in enumerate(seqs):
        z = ref.logits(seq, 0.9)                                        # [L, V] float64
        assert_close(r.logprobs[j], ref_token_logprobs(z, seq))
        check_ranks(r.token_ranks[j], z, seq)
        sorted_v, sorted_i = torch.sort(z, -1, descending=True)
        assert_close(r.topk_values[j], sorted_v[:, :10].numpy())
        sep = separated(sorted_v.numpy(), 10)
        assert np.array_equal(r.topk_ids[j][sep], sorted_i[:, :10].numpy()[sep])
        assert_close(r.candidate_logprobs[j], torch.log_softmax(z, -1).gather(-1, torch.as_tensor(cands[j])).numpy())
        assert_close(r.full_logits[j], z[:, 15990:16020].numpy())
        # tail: log of the mass outside the returned ids, by a sum over the rest of the full row
        outside = torch.log_softmax(z, -1).scatter(-1, torch.as_tensor(r.topk_ids[j]).long(), float("-inf"))
        assert_close(r.topk_tail[j], torch.logsumexp(outside, -1).numpy())
        with torch.no_grad():          # the lm_head's input, from whichever rank holds it (the last stage under PP)
            h = ref.model.base_model(torch.as_tensor(seq, dtype=torch.long)[None]).last_hidden_state[0]
        assert_close(r.hidden_states[j], h.numpy())
    assert_close(whole, ref.logits(seqs[3], 0.9).numpy())
    assert all(np.isneginf(t).all() for t in every.topk_tail)
    assert all(np.array_equal(np.sort(i, -1), np.broadcast_to(np.arange(V), i.shape)) for i in every.topk_ids)


@pytest.mark.multi_process
def test_filters_and_topk_logprobs_equal_reference(sharded):
    tp, cp, server, ref, _ = sharded
    seqs = random_seqs(np.random.default_rng(22), LENGTHS, vocab=V)
    with TeacherClient(server.address) as c:
        filtered = c.logprobs(seqs, temperature=0.8, top_k=200, top_p=0.5)
        vals, ids = c.topk(seqs, 5, as_logprobs=True)
    for j, seq in enumerate(seqs):
        assert_close(filtered[j], ref_token_logprobs(ref.logits(seq, 0.8), seq, top_k=200, top_p=0.5))
        lp = torch.log_softmax(ref.logits(seq), -1)
        assert_close(vals[j], torch.sort(lp, -1, descending=True).values[:, :5].numpy())


@pytest.mark.multi_process
def test_reward_tokens_equal_reference(sharded):
    """A causal LM as a reward model: chosen ids (on either side of the vocab split, the last beside the padding) at chosen
    positions, from whichever ranks hold them (CP runs, the last stage), one gather per block under TP."""
    tp, cp, server, ref, _ = sharded
    seqs = random_seqs(np.random.default_rng(25), LENGTHS, vocab=V)
    ids, positions = [3, 16001, V - 1, 3], [44, -45, 10, 30, -1]       # on seqs[3:] (45 and 130 tokens)
    with TeacherClient(server.address) as c:
        last = c.reward_tokens(seqs, ids, logits=True)
        lp = c.reward_tokens(seqs[3:], ids, positions=positions, temperature=0.9)
    for j, seq in enumerate(seqs):
        assert_close(last[j], ref.logits(seq)[-1:, ids].numpy())
    for j, seq in enumerate(seqs[3:]):
        z = ref.logits(seq, 0.9)
        assert_close(lp[j], torch.log_softmax(z, -1)[[p % len(seq) for p in positions]][:, ids].numpy())


@pytest.mark.multi_process
def test_http_routes_under_tp_and_cp(sharded):
    """vLLM's /v1/completions through a sharded server: bad input refused with 400 (the ranks never see it),
    then prompt_logprobs and ranks equal to the one-process float64 reference."""
    from helpers import post

    tp, cp, server, ref, _ = sharded
    seq = random_seqs(np.random.default_rng(22), [40], vocab=V)[0].tolist()
    for bad in ({"prompt": [5, V]}, {"prompt": [5, 9], "logprobs": "x"}, {"prompt": [5] * 2000}):
        status, out = post(server.http, "/v1/completions", bad)
        assert status == 400, out
    status, out = post(server.http, "/v1/completions", {"prompt": seq, "max_tokens": 0, "prompt_logprobs": 3,
                                                        "temperature": 0.9})
    assert status == 200
    plp = out["choices"][0]["prompt_logprobs"]
    z = ref.logits(seq, 0.9)
    assert_close([plp[t][str(seq[t])]["logprob"] for t in range(1, len(seq))], ref_token_logprobs(z, seq)[1:])
    check_ranks(np.array([0] + [plp[t][str(seq[t])]["rank"] for t in range(1, len(seq))], np.int32), z, seq)
    # vLLM's /generative_scoring (a causal LM as a judge): the label's probability after query + item
    query, items = seq[:24], [seq[24:30], seq[30:33]]
    status, out = post(server.http, "/generative_scoring", {"query": query, "items": items, "label_token_ids": [5, 9],
                                                            "apply_softmax": False})
    assert status == 200, out
    want = [torch.log_softmax(ref.logits(query + item)[-1], -1)[5].exp().item() for item in items]
    assert_close([d["score"] for d in out["data"]], want)


@pytest.mark.multi_process
@pytest.mark.parametrize("tp,cp", [(2, 1), (2, 2)])
def test_reward_scores_under_tp_and_cp(reward_dirs, tp, cp):
    directory = reward_dirs["llama"]
    ref = Reference(directory)
    seqs = [s + 1 for s in random_seqs(np.random.default_rng(23), [1, 5, 33], vocab=1000)]
    server = CliServer("--model", str(directory), "--tp", str(tp), "--cp", str(cp), "--device", DEVICE)
    try:
        with TeacherClient(server.address) as c:
            got = c.scores(seqs)
    finally:
        assert server.stop() == 0
    for seq, score in zip(seqs, got):
        with torch.no_grad():
            want = ref.model(torch.as_tensor(seq)[None]).logits[0].numpy()
        np.testing.assert_allclose(score, want, atol=1e-5, rtol=0)


@pytest.mark.live_server
@pytest.mark.parametrize("layout", ["--tp", "--pp"])
def test_lost_rank_fails_requests_with_unavailable_and_exits_nonzero(tp_model, layout):
    """A lost TP rank, or a lost pipeline stage (rank 1: the last, which holds the head)."""
    directory, _ = tp_model
    server = CliServer("--model", str(directory), layout, "2", "--logprob-chunk-size", "16")
    ranks = psutil.Process(server.proc.pid).children()
    assert len(ranks) == 2
    follower = next(p for p in ranks if "RANK" in p.environ() and p.environ()["RANK"] == "1")
    seqs = random_seqs(np.random.default_rng(24), [900] * 24, vocab=V)
    statuses = []
    channel = grpc.insecure_channel(server.address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=60)
    watcher = threading.Thread(target=lambda: [statuses.append(r.status) for r in _until_error(watch)], daemon=True)
    watcher.start()
    with TeacherClient(server.address) as c:
        assert c.logprobs([[1, 2, 3]])[0].shape == (3,)
        future = c.submit(seqs, Wanted(topk=2000))
        time.sleep(1.0)
        t0 = time.monotonic()
        follower.send_signal(signal.SIGKILL)
        with pytest.raises(LogitServeError) as e:
            future.result(timeout=30)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE, e.value
        with pytest.raises(LogitServeError) as after:
            c.logprobs([[1, 2, 3]])
        assert after.value.code == grpc.StatusCode.UNAVAILABLE
    code = server.proc.wait(timeout=30)
    print(f"\nlost rank: server exited {code} after {time.monotonic() - t0:.1f} s")
    assert code != 0 and time.monotonic() - t0 < 30
    watcher.join(10)
    channel.close()
    assert statuses[0] == health_pb2.HealthCheckResponse.SERVING
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses, statuses


def _until_error(stream):
    try:
        yield from stream
    except grpc.RpcError:
        return


@pytest.mark.multi_process
def test_pp2_groups_compute_the_shared_prompt_once(tp_model):
    """RL groups through two pipeline stages: the shared prompt is computed once (the prefix member and its
    continuations flow as one micro-batch's rows), and the response logprobs equal float64."""
    directory, ref = tp_model
    rng = np.random.default_rng(25)
    prompt = rng.integers(0, V, 200)
    seqs = [np.concatenate([prompt, rng.integers(0, V, n)]) for n in (5, 30, 12, 60)]
    server = CliServer("--model", str(directory), "--pp", "2", "--pp-microbatch-tokens", "128",
                       "--logprob-chunk-size", "16", "--device", DEVICE)
    try:
        with TeacherClient(server.address) as c:
            r = c.forward(seqs, logprobs=True, prompt_lengths=[200] * 4)
    finally:
        assert server.stop() == 0
    assert r.shared_prefix_tokens == 3 * 199
    for j, seq in enumerate(seqs):
        assert_close(r.logprobs[j], ref_token_logprobs(ref.logits(seq), seq)[200:])
