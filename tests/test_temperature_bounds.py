"""Temperature bounds (issue 27, item 7): T outside [1e-6, 1e6] is refused on every front-end naming the field and
the bound, and no OK answer over a sweep of extreme temperatures carries a nan or a rank against float64.

Before the bound, T = 1e-40 (gRPC; a float32 subnormal) or 1e-320 (JSON) answered OK with nan logprobs and
ranks that were not the logits' order, and T over float32's max (inf in float32) answered OK with every rank 1.
One llama (the demo tokenizer, --http-port) serves native gRPC, KServe and the vLLM, SGLang and TRL routes.
"""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from helpers import VOCAB, Reference, build_model, kserve_request, post, ref_rank_bounds, ref_token_logprobs, serve_dir
from logitserve.client import LogitServeError, TeacherClient
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc

pytestmark = pytest.mark.live_server

SEQ = [1, 5, 9, 200, 31, 7, 7, 3]
BOUND = "[1e-06, 1e+06]"
# every temperature refused: below the minimum (subnormal in float32 or float64 included) or above the maximum
REFUSED = [0.0, -1.0, 5e-324, 1e-320, 1e-45, 1e-40, 1e-38, 9.99e-7, 1.01e6, 1e30, 3.5e38, 1e300, float("nan"),
           float("inf")]
# every temperature the sweep sends: each is refused or answered with no nan and ranks in the logits' order
SWEEP = [5e-324, 1e-320, 1e-40, 1e-38, 1e-7, 1e-6, 1e-3, 0.7, 1.0, 1e3, 1e6, 2e6, 1e30, 3.5e38, 1e39, 1e300]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("temperature") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory, http_port=0)
    yield server, f"http://127.0.0.1:{server.running.http_port}", Reference(directory)
    server.stop()


def _refused_in_range(T: float) -> bool:
    return not (1e-6 <= T <= 1e6)


def _grpc_native(server, T):
    with TeacherClient(server.address) as c:
        return c.logprobs([SEQ], temperature=T)


def _kserve(server, T):
    with grpc.insecure_channel(server.address) as ch:
        return kpb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(kserve_request([SEQ], ["token_logprobs"], temperature=T))


def _http_body(route: str, T: float) -> dict:
    return {"/v1/completions": {"prompt": SEQ, "max_tokens": 0, "echo": True, "prompt_logprobs": 2, "temperature": T},
            "/inference/v1/generate": {"token_ids": SEQ, "sampling_params": {"max_tokens": 0, "prompt_logprobs": 2,
                                                                             "temperature": T}},
            "/generate": {"input_ids": SEQ, "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 0, "temperature": T}},
            "/get_sequence_logprobs/": {"sequences": [SEQ], "prompt_lengths": [1], "top_logprobs": 2,
                                        "temperature": T}}[route]


HTTP_FIELD = {"/v1/completions": "temperature", "/inference/v1/generate": "sampling_params.temperature",
              "/generate": "sampling_params.temperature", "/get_sequence_logprobs/": "temperature"}


@pytest.mark.parametrize("T", [1e-40, 9.99e-7, 1.01e6, 1e39], ids=["1e-40", "under-min", "over-max", "1e39"])
def test_grpc_front_ends_refuse_temperatures_outside_the_bound(served, T):
    server, _, _ = served
    with pytest.raises(LogitServeError) as e:
        _grpc_native(server, T)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details.startswith("temperature: ") and BOUND in e.value.details
    with pytest.raises(grpc.RpcError) as e:
        _kserve(server, T)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters[temperature]" in e.value.details() and BOUND in e.value.details()


@pytest.mark.parametrize("route", list(HTTP_FIELD))
def test_http_routes_refuse_temperatures_outside_the_bound(served, route):
    _, base, _ = served
    for T in (1e-320, 9.99e-7, 1.01e6, 1e300):       # JSON keeps float64: 1e-320 arrives as the subnormal it is
        status, out = post(base, route, _http_body(route, T))
        assert status == 400, (route, T, out)
        err = out["error"]
        assert err["param"] == HTTP_FIELD[route] and BOUND in err["message"], (route, T, err)
    status, out = post(base, route, _http_body(route, 0))          # 0 keeps vLLM's meaning there: T = 1
    assert status == 200, out


def test_the_bound_is_one_check_for_every_job():
    from logitserve.errors import InvalidRequest
    from logitserve.spec import Job, LogprobsOpts, ModelKind, ModelLimits
    from logitserve.validate import MAX_TEMPERATURE, MIN_TEMPERATURE, validate_job

    limits = ModelLimits(vocab_size=VOCAB, max_seq_len=64, kind=ModelKind.CAUSAL_LM)
    seqs = (np.asarray(SEQ, np.int32),)
    for T in REFUSED:
        with pytest.raises(InvalidRequest) as e:
            validate_job(Job(sequences=seqs, temperature=T, logprobs=LogprobsOpts()), limits)
        assert e.value.field == "temperature" and BOUND in str(e.value)
    for T in (MIN_TEMPERATURE, 1.0, MAX_TEMPERATURE):
        validate_job(Job(sequences=seqs, temperature=T, logprobs=LogprobsOpts()), limits)


def test_no_ok_grpc_answer_carries_nan_over_extreme_temperatures(served):
    """Every output at once (token logprobs with ranks, top-k logprobs with the tail, candidates, full logits),
    unfiltered and under top_p: each temperature is refused, or its answer has no nan, ranks within the float64
    reference's bounds (ranks are of z: T must not change them) and logprobs within fp32's error of it."""
    server, _, ref = served
    z = ref.logits(SEQ)                                                          # [L, V] float64, T = 1
    lo, hi = ref_rank_bounds(z, SEQ)
    answered = 0
    with TeacherClient(server.address) as c:
        for T in SWEEP:
            for top_p in (None, 0.5):
                try:
                    r = c.forward([SEQ], temperature=T, logprobs=True, token_ranks=True, top_p=top_p, topk=4,
                                  topk_as_logprobs=True, topk_tail=True, candidates=[np.tile([0, 7], (len(SEQ), 1))],
                                  full_logits=True)
                except LogitServeError as e:
                    assert _refused_in_range(T) and e.code == grpc.StatusCode.INVALID_ARGUMENT, (T, e)
                    continue
                for name in ("logprobs", "topk_values", "topk_tail", "candidate_logprobs", "full_logits"):
                    assert not np.isnan(getattr(r, name)[0]).any(), (T, top_p, name)
                ranks = r.token_ranks[0]
                assert ((lo <= ranks) & (ranks <= hi)).all(), (T, ranks, lo, hi)
                assert not _refused_in_range(T), f"T={T:g} answered OK"
                answered += 1
                if top_p is None:
                    want = ref_token_logprobs(z / T, SEQ)
                    # fp32 logits are within ~1e-5 of float64 ones; dividing by T scales that error by 1/T
                    tol = 1e-4 * max(1.0, 1.0 / T)
                    assert np.abs(r.logprobs[0] - want).max() <= tol, (T, r.logprobs[0], want)
    assert answered == 2 * sum(not _refused_in_range(T) for T in SWEEP)


def _numbers(route: str, out) -> list:
    """Every logprob an HTTP answer holds, in order (None where the route writes null)."""
    if route in ("/v1/completions", "/inference/v1/generate"):
        entries = out["choices"][0]["prompt_logprobs"] if route == "/v1/completions" else out["prompt_logprobs"]
        assert entries[0] is None                                          # token 0 has no distribution
        return [e["logprob"] for d in entries[1:] for e in d.values()]
    if route == "/generate":
        rows = out["meta_info"]["input_token_logprobs"]
        assert rows[0][0] is None
        return [v for v, _, _ in rows[1:]]
    return [v for row in out["logprobs"][0] for v in row]


@pytest.mark.parametrize("route", list(HTTP_FIELD))
def test_no_ok_http_answer_carries_nan_or_null_over_extreme_temperatures(served, route):
    _, base, _ = served
    for T in SWEEP:
        status, out = post(base, route, _http_body(route, T))
        if status == 200:
            values = _numbers(route, out)
            assert values and all(isinstance(v, float) and not np.isnan(v) for v in values), (route, T, values)
        if _refused_in_range(T):
            assert status == 400 and out["error"]["param"] == HTTP_FIELD[route], (route, T, out)
        else:
            assert status == 200, (route, T, out)
