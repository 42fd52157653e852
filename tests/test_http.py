"""The HTTP front-end as vLLM's, SGLang's and TRL's clients call it, every value against float64 transformers.

Requests are what those frameworks send (the `openai` package itself; raw replays of ms-swift's
TeacherAPIClient, TRL's AsyncDistillationTrainer and VLLMClient, slime's SGLang call, prime-rl's
/inference/v1/generate), parsed the way their code parses the answers.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

from helpers import (VOCAB, Reference, assert_close, build_model, post, random_seqs, ref_rank_bounds,
                     ref_token_logprobs, separated, serve_dir)

K = 5


@pytest.fixture(scope="module")
def http_model(tmp_path_factory):
    """A llama with the demo tokenizer, served with --http-port; its float64 reference."""
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("http") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory, http_port=0, served_model_names=("teacher", "alias"))
    yield f"http://127.0.0.1:{server.running.http_port}", server, Reference(directory)
    server.stop()


def get(base: str, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(base + path, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _check_position(entry: dict, z_row: torch.Tensor, target: int, k: int, lo: int, hi: int) -> None:
    """One vLLM prompt_logprobs dict: the target first with its logprob and rank, then the top-k by rank."""
    lsm = torch.log_softmax(z_row, -1)
    items = list(entry.items())
    first_id, first = items[0]
    assert int(first_id) == target
    assert_close([first["logprob"]], [lsm[target].item()])
    assert lo <= first["rank"] <= hi
    top = [(int(i), e) for i, e in items if not (int(i) == target and e is first)]
    sorted_v, sorted_i = torch.sort(lsm, descending=True)
    assert len(items) in (k, k + 1) and (len(items) == k) == (first["rank"] <= k)
    ranks = [e["rank"] for _, e in top]
    assert ranks == sorted(ranks) and set(ranks) <= set(range(1, k + 1))
    sep = separated(sorted_v[None].numpy(), k)[0]
    for i, e in top:
        r = e["rank"] - 1
        assert_close([e["logprob"]], [sorted_v[r].item()])
        if sep[r]:
            assert i == sorted_i[r].item()


@pytest.mark.live_server
def test_openai_package_echo_prompt_logprobs(http_model):
    """The `openai` package's completions.create as ms-swift's echo-style call: every position checked."""
    import openai

    base, _, ref = http_model
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["teacher"]
    seq = random_seqs(np.random.default_rng(5), [23])[0].tolist()
    out = client.completions.create(model="teacher", prompt=seq, echo=True, logprobs=K, max_tokens=0,
                                    temperature=0, extra_body={"prompt_logprobs": K})
    choice = out.choices[0]
    z = ref.logits(seq)                                                          # T = 0 means 1 (vLLM's values)
    lo, hi = ref_rank_bounds(z, seq)
    plp = choice.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(seq)
    for t in range(1, len(seq)):
        _check_position(plp[t], z[t - 1], seq[t], K, lo[t], hi[t])
    block = choice.logprobs
    assert block.token_logprobs[0] is None and len(block.tokens) == len(seq)
    assert_close(block.token_logprobs[1:], ref_token_logprobs(z, seq)[1:])
    assert all(len(d) <= K + 1 for d in block.top_logprobs[1:])
    assert out.usage.prompt_tokens == len(seq) and out.usage.completion_tokens == 0


@pytest.mark.live_server
def test_ms_swift_and_trl_vllm_requests(http_model):
    """ms-swift's fetch_teacher_logprobs and TRL's post-#6765 teacher call: prompt_logprobs with max_tokens 1, a
    batch of prompts, temperature applied (0.7), parsed as they parse it (skip 0, sort, keep k)."""
    base, _, ref = http_model
    seqs = [s.tolist() for s in random_seqs(np.random.default_rng(6), [9, 30, 2])]
    status, out = post(base, "/v1/completions", {"model": "alias", "prompt": seqs, "max_tokens": 1,
                                                 "temperature": 0.7, "prompt_logprobs": K})
    assert status == 200 and len(out["choices"]) == 3
    for seq, choice in zip(seqs, out["choices"]):
        z = ref.logits(seq, 0.7)
        lo, hi = ref_rank_bounds(z, seq)
        plp = choice["prompt_logprobs"]
        for t in range(1, len(seq)):                                            # ms-swift: raw[1:]
            _check_position(plp[t], z[t - 1], seq[t], K, lo[t], hi[t])
            top = sorted(plp[t].items(), key=lambda kv: -kv[1]["logprob"])[:K]   # ms-swift's parse
            assert len(top) == K
        # TRL: the actual token's logprob by its string id
        got = [plp[t][str(seq[t])]["logprob"] for t in range(1, len(seq))]
        assert_close(got, ref_token_logprobs(z, seq)[1:])
        greedy = choice["text"]                                                  # max_tokens 1: the greedy token
        sorted_v = torch.sort(z[-1], descending=True).values
        if sorted_v[0] - sorted_v[1] > 1e-5:
            assert f"t{int(torch.argmax(z[-1]))}" in greedy
    assert out["usage"]["completion_tokens"] == 3


@pytest.mark.live_server
def test_prompt_logprob_start_and_prime_rl_generate(http_model):
    """prompt_logprob_start (response rows only; earlier entries null) and prime-rl's /inference/v1/generate,
    with vLLM PR #54335's per-row candidate ids as a .npy answer."""
    base, _, ref = http_model
    seq = random_seqs(np.random.default_rng(7), [20])[0].tolist()
    z = ref.logits(seq)
    lp = ref_token_logprobs(z, seq)
    status, out = post(base, "/v1/completions", {"prompt": seq, "max_tokens": 0, "prompt_logprobs": 2,
                                                 "prompt_logprob_start": 11})
    plp = out["choices"][0]["prompt_logprobs"]
    assert status == 200 and plp[:12] == [None] * 12 and len(plp) == 20
    assert_close([plp[t][str(seq[t])]["logprob"] for t in range(12, 20)], lp[12:])
    status, out = post(base, "/inference/v1/generate", {"model": "teacher", "token_ids": seq, "sampling_params": {
        "max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}})
    assert status == 200
    got = [0.0 if e is None else next(iter(e.values()))["logprob"] for e in out["prompt_logprobs"]]   # prime-rl
    assert_close(got, lp)
    cand = np.random.default_rng(8).integers(0, VOCAB, (20 - 1 - 4, 3))
    status, out = post(base, "/inference/v1/generate", {"token_ids": seq, "sampling_params": {
        "max_tokens": 1, "prompt_logprob_start": 4, "prompt_logprob_token_ids": cand.tolist()}})
    assert status == 200
    import io

    arr = np.load(io.BytesIO(base64.b64decode(out["prompt_token_id_logprobs"])))
    want = torch.log_softmax(z, -1)[5 - 1 : 19].gather(-1, torch.as_tensor(cand)).numpy()   # row i: token 5 + i
    assert arr.dtype == np.float32 and arr.shape == (15, 3)
    assert_close(arr, want)


@pytest.mark.live_server
def test_slime_sglang_generate(http_model):
    """slime's teacher call: /generate with input_ids, logprob_start_len 0, max_new_tokens 0, parsed as slime does;
    top_logprobs_num, token_ids_logprob and a batch as SGLang shapes them."""
    base, _, ref = http_model
    prompt, response = random_seqs(np.random.default_rng(9), [12, 7])
    ids = np.concatenate([prompt, response]).tolist()
    status, out = post(base, "/generate", {"input_ids": ids, "sampling_params": {
        "temperature": 0.8, "max_new_tokens": 0, "skip_special_tokens": False}, "return_logprob": True,
        "logprob_start_len": 0})
    assert status == 200
    t_log_prob = [item[0] for item in out["meta_info"]["input_token_logprobs"][1:]][-len(response):]   # slime's
    z = ref.logits(ids, 0.8)
    assert_close(t_log_prob, ref_token_logprobs(z, ids)[-len(response):])
    assert out["meta_info"]["input_token_logprobs"][0][0] is None and out["meta_info"]["completion_tokens"] == 0
    status, out = post(base, "/generate", {"input_ids": [ids, ids[:5]], "return_logprob": True,
                                           "logprob_start_len": 3, "top_logprobs_num": 3, "token_ids_logprob": [7, 8],
                                           "sampling_params": {"max_new_tokens": 0}})
    assert status == 200 and isinstance(out, list) and len(out) == 2
    z = ref.logits(ids)
    lsm = torch.log_softmax(z, -1)
    meta = out[0]["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == ids[3:] and meta["input_top_logprobs"][0] is None
    assert_close([e[0] for e in meta["input_token_logprobs"][1:]], ref_token_logprobs(z, ids)[4:])
    for t, top in zip(range(4, len(ids)), meta["input_top_logprobs"][1:]):
        assert_close([v for v, _, _ in top], torch.sort(lsm[t - 1], descending=True).values[:3].numpy())
    for t, c in zip(range(4, len(ids)), meta["input_token_ids_logprobs"][1:]):
        assert [i for _, i, _ in c] == [7, 8]
        assert_close([v for v, _, _ in c], lsm[t - 1, [7, 8]].numpy())
    assert len(out[1]["meta_info"]["input_token_logprobs"]) == 2


@pytest.mark.live_server
def test_trl_sequence_logprobs_json_and_binary(http_model):
    """TRL's /get_sequence_logprobs/ (AsyncDistillationTrainer's json, VLLMClient's binary decode)."""
    base, _, ref = http_model
    seqs = [s.tolist() for s in random_seqs(np.random.default_rng(10), [15, 6])]
    pls = [10, 0]
    body = {"sequences": seqs, "prompt_lengths": pls, "top_logprobs": 4, "temperature": 0.9}
    status, js = post(base, "/get_sequence_logprobs/", {**body, "response_format": "json"})
    status2, bn = post(base, "/get_sequence_logprobs/", {**body, "response_format": "binary"})
    assert status == status2 == 200
    shape = bn["shape"]
    dec = {k: np.frombuffer(base64.b64decode(bn[k + "_b64"]), dtype=np.float32 if "logprobs" in k else np.int32)
           for k in ("logprobs", "token_ids", "actual_logprobs", "actual_token_ids")}
    lp = dec["logprobs"].reshape(shape)
    ids = dec["token_ids"].reshape(shape)
    act = dec["actual_logprobs"].reshape(shape[0], shape[1], 1)
    assert bn["completion_lengths"] == [5, 6] and shape == [2, 6, 4]
    for b, (seq, pl) in enumerate(zip(seqs, pls)):
        z = ref.logits(seq, 0.9)
        lsm = torch.log_softmax(z, -1)
        want_lp = ref_token_logprobs(z, seq)
        for j, t in enumerate(range(pl, len(seq))):
            if t == 0:                                       # no distribution before token 0
                assert js["logprobs"][b][j] == [] and np.all(np.isneginf(lp[b, j]))
                continue
            sorted_v = torch.sort(lsm[t - 1], descending=True).values[:4].numpy()
            assert_close(lp[b, j], sorted_v)
            assert_close(js["logprobs"][b][j][:4], sorted_v)
            assert js["logprob_token_ids"][b][j][:4] == ids[b, j].tolist()
            assert_close(act[b, j], [want_lp[t]])
            if seq[t] not in ids[b, j]:
                assert js["logprob_token_ids"][b][j][4] == seq[t] and len(js["logprobs"][b][j]) == 5
        assert np.all(np.isneginf(lp[b, len(seq) - pl:]))      # padding


@pytest.mark.live_server
def test_reward_routes(reward_dirs):
    """vLLM's /classify and /pooling and SGLang's /classify on a reward model; completions refused with 400."""
    server = serve_dir(reward_dirs["llama"], http_port=0)
    base = f"http://127.0.0.1:{server.running.http_port}"
    try:
        ref = Reference(reward_dirs["llama"])
        seqs = [s.tolist() for s in random_seqs(np.random.default_rng(12), [7, 13])]
        with torch.no_grad():
            want = np.stack([ref.model(torch.as_tensor([s])).logits[0].numpy() for s in seqs])   # [2, 2] float64
        status, out = post(base, "/classify", {"input": seqs, "use_activation": False})
        assert status == 200 and [d["num_classes"] for d in out["data"]] == [2, 2]
        assert_close([d["probs"] for d in out["data"]], want)
        status, out = post(base, "/pooling", {"input": seqs})
        assert_close([d["data"] for d in out["data"]], torch.softmax(torch.as_tensor(want), -1).numpy())
        status, out = post(base, "/classify", {"input_ids": seqs[0]})
        assert status == 200
        assert_close(out["embedding"], want[0])
        status, out = post(base, "/v1/completions", {"prompt": seqs[0], "prompt_logprobs": 1})
        assert status == 400 and "/classify" in out["error"]["message"]
    finally:
        server.stop()


BAD = [
    ({"prompt": [5, 9], "logprobs": "abc"}, 400, "logprobs"),
    ({"prompt": [5, 9], "temperature": "x"}, 400, "temperature"),
    ({"prompt": [5, 9], "prompt_logprobs": 2.5}, 400, "prompt_logprobs"),
    ({"prompt": 123}, 400, "prompt"),
    ({"prompt": [[5, "a"]]}, 400, "prompt[0][1]"),
    ({"prompt": [5, True]}, 400, "prompt[1]"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [5, 9], "prompt_logprobs": VOCAB + 1}, 400, "prompt_logprobs"),
    ({"prompt": [5, VOCAB]}, 400, "prompt[0][1]"),
    ({"prompt": [5, -1]}, 400, "prompt[0][1]"),
    ({"prompt": [5, 2**40]}, 400, "prompt[1]"),
    ({"prompt": [5, 9], "stream": True, "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ({"prompt": [5, 9], "max_tokens": 2}, 400, "max_tokens"),
    ({"prompt": [5, 9], "n": 2}, 400, "n"),
    ({"prompt": [5, 9], "model": "other"}, 404, "model"),
    ({"prompt": [5] * 600}, 400, "prompt[0]"),
]


@pytest.mark.live_server
def test_bad_input_gets_its_status_and_the_server_keeps_serving(http_model):
    base, server, _ = http_model
    for body, status, param in BAD:
        got, out = post(base, "/v1/completions", body)
        assert got == status, (body, out)
        err = out["error"]
        assert err["code"] == status and err["param"] == param and param.split("[")[0] in err["message"], (body, err)
    for path, body, param in [("/v1/completions", b"{not json", "body"), ("/generate", {"input_ids": "x"}, "input_ids"),
                              ("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}},
                               "sampling_params.max_new_tokens"),
                              ("/get_sequence_logprobs/", {"sequences": [[1, 2]], "prompt_lengths": [3]},
                               "prompt_lengths[0]"),
                              ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"logprobs": "x"}},
                               "sampling_params.logprobs"),
                              ("/classify", {"input": [1, 2]}, "input")]:
        got, out = post(base, path, body)
        assert got == 400 and out["error"]["param"] == param, (path, out)
    import http.client                                                       # over --max-request-bytes: refused
    conn = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)  # from the headers, body unsent
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(65 << 20))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413 and "--max-request-bytes" in json.loads(resp.read())["error"]["message"]
    conn.close()
    got, out = post(base, "/v1/completions", {"prompt": [5, 9, 13], "prompt_logprobs": 1})
    assert got == 200 and out["choices"][0]["prompt_logprobs"][2]
    registry = server.running.metrics.registry
    assert registry.get_sample_value("logitserve_requests_total", {"output": "logprobs", "status": "OK"}) >= 1
    assert get(base, "/health")[0] == 200 and get(base, "/nope")[0] == 404


@pytest.mark.live_server
def test_bearer_tokens_on_http(tmp_path, model_dirs):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    from logitserve.server.security import SecurityConfig

    server = serve_dir(model_dirs["llama"], http_port=0, security=SecurityConfig(auth_token_file=str(tokens)))
    base = f"http://127.0.0.1:{server.running.http_port}"
    try:
        body = {"prompt": [5, 9, 13], "prompt_logprobs": 1}
        assert post(base, "/v1/completions", body)[0] == 401
        assert post(base, "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 403
        assert post(base, "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        assert get(base, "/health")[0] == 200                                   # health needs no token
        assert get(base, "/v1/models")[0] == 401
    finally:
        server.stop()


@pytest.mark.live_server
@pytest.mark.parametrize("block", [7, 4])      # 7 entries: blocks of whole rows; 4 < k: each row in column slices
def test_column_wise_json_equals_vllms_dicts(http_model, monkeypatch, block):
    """json_logprobs builds prompt_logprobs from arrays; parsed, it is the dict-per-entry list, key order and all."""
    import orjson

    from logitserve.server.http_common import TokenTexts
    from logitserve.server.json_logprobs import VocabTables
    from logitserve.server.openai_api import _prompt_dicts, _prompt_json
    from logitserve.server.scoring import Rows

    _, server, _ = http_model
    texts = TokenTexts(server.running.pipeline.text)

    class Ctx:
        pass

    ctx = Ctx()
    ctx.texts, ctx.tables = texts, VocabTables(texts, VOCAB)
    rng = np.random.default_rng(13)
    L, k = 40, 6
    seq = rng.integers(0, VOCAB, L).astype(np.int32)
    top = np.stack([rng.permutation(VOCAB)[:k] for _ in range(L - 3)]).astype(np.int32)
    top[::3, 2] = seq[3::3]                                       # some targets inside the top-k (deduplicated)
    values = -np.sort(rng.exponential(3, (L - 3, k)).astype(np.float32), axis=1)
    values[0, -1] = -np.inf                                       # clamped to -9999.0 as vLLM does
    rows = Rows(3, rng.normal(-5, 2, L - 3).astype(np.float32), rng.integers(1, 900, L - 3).astype(np.int32),
                values, top, None, None, None)
    from logitserve.server import http_answer, json_logprobs

    # produced a block of rows at a time and sent in slices, as an answer streams: small sizes cross every cut
    monkeypatch.setattr(json_logprobs, "BLOCK_ENTRIES", block)
    monkeypatch.setattr(http_answer, "CHUNK_BYTES", 100)
    slices = list(http_answer.pieces({"a": [1, _prompt_json(seq, rows, k, ctx, L)], "b": "after"}))
    assert len(slices) > 10 and max(len(x) for x in slices) <= 100
    whole = orjson.loads(b"".join(bytes(x) for x in slices))
    got = whole["a"][1]
    assert whole["a"][0] == 1 and whole["b"] == "after"
    want = [None] * 3 + _prompt_dicts(seq, rows, k, ctx, L)
    assert got == want and all(list(g) == list(w) for g, w in zip(got[3:], want[3:]))
    assert got[1 + 3][str(top[1, -1])]["logprob"] == values[1, -1].item() and want[3][str(top[0, -1])]["logprob"] == -9999.0


TRL_CLIENT = r"""
import json, sys, requests
from trl.generation.vllm_client import VLLMClient
base, seqs, pls = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
# VLLMClient's constructor insists on vLLM being importable (its generation side); the teacher path is this:
client = VLLMClient.__new__(VLLMClient)
client.session, client.base_url = requests.Session(), base
client.check_server(total_timeout=10)                          # GET /health
client.model = requests.get(base + "/v1/models").json()["data"][0]["id"]   # as TRL reads it
out = client.get_sequence_logprobs(seqs, pls, top_logprobs=4, temperature=0.9)
print(json.dumps(out).replace("-Infinity", "null"))
"""


@pytest.mark.fresh_venv
def test_trl_vllm_client_get_sequence_logprobs(http_model, tmp_path):
    """TRL's own VLLMClient.get_sequence_logprobs (trl 1.16, installed here without its vLLM side) against the
    server: its parse of prompt_logprobs gives the reference top-k and the realized tokens' logprobs."""
    base, _, ref = http_model
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), "trl==1.16.0",
                    "requests", "urllib3", "idna", "charset-normalizer", "certifi"], check=True, timeout=600)
    seqs = [s.tolist() for s in random_seqs(np.random.default_rng(14), [12, 9])]
    pls = [8, 1]
    run = subprocess.run([sys.executable, "-c", TRL_CLIENT, base, json.dumps(seqs), json.dumps(pls)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    for b, (seq, pl) in enumerate(zip(seqs, pls)):
        z = ref.logits(seq, 0.9)
        lsm = torch.log_softmax(z, -1)
        want = ref_token_logprobs(z, seq)
        assert len(out["logprobs"][b]) == len(seq) - pl
        for j, t in enumerate(range(pl, len(seq))):
            assert_close(out["logprobs"][b][j], torch.sort(lsm[t - 1], descending=True).values[:4].numpy())
            assert out["actual_token_ids"][b][j] == [seq[t]]
            assert_close(out["actual_logprobs"][b][j], [want[t]])


@pytest.mark.unit
def test_bulk_encoding_yields_to_compute_and_small_answers_skip_its_queue():
    """While compute runs, each slice of a bulk answer is followed by BULK_YIELD times its encoding CPU time;
    answers holding at most QUICK_BYTES are encoded on their own thread, never behind a bulk slice."""
    import asyncio
    import threading
    import time

    from logitserve.server import http_answer

    class Sched:                      # the two members of Scheduler that AnswerHold uses
        busy = True

        def reserve(self, client, nbytes, what):
            pass

        def release(self, client, nbytes):
            pass

    def slices():
        for _ in range(3):
            t0 = time.thread_time()
            while time.thread_time() - t0 < 0.02:          # 20 ms of CPU per slice
                pass
            yield threading.current_thread().name.encode()

    async def drain(hold):
        it, names, t0 = slices(), [], time.monotonic()
        while (piece := await http_answer.next_piece(it, hold)) is not None:
            names.append(piece.decode())
        return time.monotonic() - t0, names

    sched = Sched()
    bulk = http_answer.AnswerHold(sched, "c")
    bulk.reserve(2 * http_answer.QUICK_BYTES, "test")
    busy_s, names = asyncio.run(drain(bulk))
    assert busy_s >= 3 * 0.02 * (1 + http_answer.BULK_YIELD) * 0.9 and all("encode" in n for n in names), names
    sched.busy = False
    idle_s, _ = asyncio.run(drain(bulk))
    assert idle_s < busy_s / 2, (idle_s, busy_s)
    _, names = asyncio.run(drain(http_answer.AnswerHold(sched, "c")))
    assert all("quick" in n for n in names), names
