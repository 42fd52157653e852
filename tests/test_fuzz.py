"""Hypothesis-made malformed requests against a live server: each gets a clear status (never INTERNAL) or is
ignored, on streams of several requests with cancel storms and hang-ups, and KServe requests with parameters of
every type and tensors of every shape; the server never crashes or hangs, memory stays bounded, and a good
request afterwards is answered right. CI runs a few hundred cases at TP 1 and a short run at TP 2;
`pytest -m slow tests/test_fuzz.py` runs 10,000."""
from __future__ import annotations

from collections import Counter

import grpc
import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import CliServer, ref_token_logprobs
from logitserve.client import TeacherClient
from logitserve.kserve import grpc_predict_v2_pb2 as kpb
from logitserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
CODES = {c.value[0]: c for c in grpc.StatusCode}
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED

ints = st.one_of(st.integers(-5, 40), st.integers(-(2 ** 63), 2 ** 63 - 1), st.sampled_from([0, 1, 1002, 1003, 1004]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.01, 3.0))
dims = st.one_of(st.integers(0, 40), st.integers(-3, 2 ** 62))


@st.composite
def tensors(draw, ids=True):
    shape = draw(st.lists(dims, min_size=0, max_size=3))
    kind = draw(st.sampled_from(["ids", "random", "empty"]))
    if kind == "ids" and all(0 <= d <= 40 for d in shape) and ids:
        n = int(np.prod(shape))                                   # ids, mostly in range, from a drawn seed
        data = np.random.default_rng(draw(st.integers(0, 2 ** 32))).integers(-3, 1100, n).astype("<i4").tobytes()
    elif kind == "random":
        data = draw(st.binary(max_size=256))
    else:
        data = b""
    return pb.Tensor(dtype=draw(st.integers(-2, 9)), shape=shape, data=data)


request_ids = st.one_of(st.text(max_size=8), st.text(max_size=300), st.sampled_from(["a\nb", "\r\n{}", "x" * 5000]))


@st.composite
def requests(draw):
    req = pb.ForwardRequest(request_id=draw(request_ids))
    req.sequences.extend(draw(st.lists(tensors(), max_size=4)))
    if draw(st.booleans()):
        req.temperature = draw(floats)
    if draw(st.booleans()):
        req.logprobs.SetInParent()
        if draw(st.booleans()):
            req.logprobs.top_k = draw(ints)
        if draw(st.booleans()):
            req.logprobs.top_p = draw(floats)
    if draw(st.booleans()):
        req.topk.k = draw(ints)
        req.topk.as_logprobs = draw(st.booleans())
        req.topk.dtype = draw(st.integers(-1, 6))
        req.topk.tail_mass = draw(st.booleans())
    if draw(st.booleans()):
        req.candidates.ids.extend(draw(st.lists(tensors(), max_size=3)))
    if draw(st.booleans()):
        f = req.full_logits
        f.SetInParent()
        for name in ("seq_start", "seq_end", "vocab_start", "vocab_end"):
            if draw(st.booleans()):
                setattr(f, name, draw(ints))
        f.dtype = draw(st.integers(-1, 6))
    if draw(st.booleans()):
        req.scores.SetInParent()
    if draw(st.booleans()):
        req.timeout_s = draw(floats)
    if draw(st.integers(0, 9)) == 0:
        req.texts.extend(draw(st.lists(st.text(max_size=20), max_size=2)))
    if draw(st.integers(0, 9)) == 0:
        req.cancel = True
    return req


@st.composite
def valid_requests(draw):
    """A well-formed request, so that cancels and hang-ups meet work really queued and running."""
    lengths = draw(st.lists(st.integers(1, 300), min_size=1, max_size=6))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32)))
    req = pb.ForwardRequest(request_id=draw(st.text(min_size=1, max_size=8)))
    req.sequences.extend(pb.Tensor(dtype=pb.INT32, shape=[n], data=rng.integers(0, 1003, n).astype("<i4").tobytes())
                         for n in lengths)
    which = draw(st.sampled_from(["logprobs", "topk", "full", "scores"]))
    if which == "logprobs":
        req.logprobs.SetInParent()
    elif which == "topk":
        req.topk.k = draw(st.integers(1, 1003))
        req.topk.tail_mass = draw(st.booleans())
    elif which == "full":
        req.full_logits.SetInParent()
    else:
        req.scores.SetInParent()     # a causal LM has none: FAILED_PRECONDITION
    return req


@st.composite
def streams(draw):
    """One stream's messages: one to four fuzzed requests, then maybe a cancel storm over their ids (and some
    unknown ones), and maybe a hang-up mid-response."""
    reqs = draw(st.lists(st.one_of(requests(), valid_requests()), min_size=1, max_size=4))
    if draw(st.integers(0, 3)) == 0:
        ids = [r.request_id for r in reqs] + draw(st.lists(st.text(max_size=8), max_size=3))
        reqs += [pb.ForwardRequest(request_id=i, cancel=True) for i in draw(st.permutations(ids))]
    return reqs, draw(st.booleans()) and not any(r.cancel for r in reqs)


KSERVE_NAMES = ["k", "temperature", "top_k", "top_p", "topk_as_logprobs", "topk_dtype", "seq_start", "seq_end",
                "vocab_start", "vocab_end", "timeout_s", "timeout", "priority", "classification", "sequence_id", "x\ny"]
KSERVE_OUTPUTS = ["token_logprobs", "topk_values", "topk_ids", "topk_tail", "candidate_logprobs", "full_logits",
                  "scores", "nope"]
KSERVE_ALLOWED = ALLOWED | {grpc.StatusCode.NOT_FOUND}
param_values = st.one_of(st.booleans(), st.integers(-(2 ** 63), 2 ** 63 - 1), st.integers(-3, 1100),
                         st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1.0, 4.0, 0.5, 1003.0]),
                         st.text(max_size=6), st.sampled_from(["FP32", "bf16", "true", "false"]),
                         st.integers(0, 2 ** 64 - 1), st.none())


def _set_param(p, value) -> None:
    if value is None:
        return                        # an InferParameter with no value
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        if value >= 2 ** 63:
            p.uint64_param = value
        else:
            p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = value


@st.composite
def kserve_tensor(draw, name):
    datatype = draw(st.sampled_from(["INT32", "INT64", "FP32", "BYTES", ""]))
    shape = draw(st.lists(st.one_of(st.integers(0, 12), st.integers(-2, 2 ** 40), st.just(2 ** 32)), max_size=3))
    count = int(np.prod(shape)) if all(0 <= d <= 12 for d in shape) else 0
    width = 8 if datatype == "INT64" else 4
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32)))
    how = draw(st.sampled_from(["ids", "wide", "random"]))
    if how == "ids" and count:
        raw = rng.integers(-2, 1010, count).astype("<i8" if width == 8 else "<i4").tobytes()
    elif how == "wide" and count and width == 8:
        raw = rng.integers(-(2 ** 40), 2 ** 40, count).astype("<i8").tobytes()
    else:
        raw = draw(st.binary(max_size=64))
    return kpb.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape), raw


@st.composite
def valid_kserve_requests(draw):
    """A well-formed ModelInfer, with one parameter of a fuzzed type now and then."""
    lengths = draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32)))
    ids = np.zeros((len(lengths), max(lengths)), np.int32)
    for b, n in enumerate(lengths):
        ids[b, :n] = rng.integers(0, 1003, n)
    req = kpb.ModelInferRequest(model_name="", id=draw(st.text(max_size=8)))
    req.inputs.add(name="input_ids", datatype="INT32", shape=list(ids.shape))
    req.raw_input_contents.append(ids.tobytes())
    req.inputs.add(name="sequence_lengths", datatype="INT32", shape=[len(lengths)])
    req.raw_input_contents.append(np.asarray(lengths, np.int32).tobytes())
    outputs = draw(st.sampled_from([["token_logprobs"], ["topk_values", "topk_ids"], ["full_logits"]]))
    for name in outputs:
        req.outputs.add(name=name)
    if "topk_values" in outputs:
        _set_param(req.parameters["k"], draw(st.sampled_from([5, 5.0, 1003, 2.5, "5", float("nan")])))
    if draw(st.booleans()):
        _set_param(req.parameters[draw(st.sampled_from(KSERVE_NAMES[:13]))], draw(param_values))
    return req


@st.composite
def kserve_requests(draw):
    if draw(st.integers(0, 2)) == 0:
        return draw(valid_kserve_requests())
    req = kpb.ModelInferRequest(model_name=draw(st.sampled_from(["", "", "other"])), id=draw(request_ids))
    for name in draw(st.lists(st.sampled_from(["input_ids", "input_ids", "sequence_lengths", "candidate_ids"]),
                              max_size=3)):
        tensor, raw = draw(kserve_tensor(name))
        req.inputs.append(tensor)
        req.raw_input_contents.append(raw)
    for name in draw(st.lists(st.sampled_from(KSERVE_OUTPUTS), max_size=3, unique=True)):
        out = req.outputs.add(name=name)
        if draw(st.integers(0, 3)) == 0:
            _set_param(out.parameters["k"], draw(param_values))
    for name in draw(st.lists(st.sampled_from(KSERVE_NAMES), max_size=5, unique=True)):
        _set_param(req.parameters[name], draw(param_values))
    return req


@pytest.fixture(scope="module")
def fuzz_server(model_dirs):
    """`logitserve serve` in its own process, so its RSS is the server's alone and a crash is seen."""
    server = CliServer("--model", str(model_dirs["llama"]), "--logprob-chunk-size", "16")
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.LogitServeStub(channel)
    channel.close()
    assert server.stop() == 0


def _exchange(stub, reqs: list, hang_up: bool, seen: Counter) -> None:
    """Send one stream; count what came back. A hang of the server shows as this call's own deadline, which is
    not an allowed status. A request answered in full reports the chunks that arrived for it and its tokens."""
    ids = Counter(r.request_id for r in reqs if not r.cancel)
    sent = {r.request_id: r for r in reqs if not r.cancel and ids[r.request_id] == 1}   # ids told apart
    chunks = Counter()
    call = stub.Forward(iter(reqs), timeout=30)
    try:
        for msg in call:
            if hang_up:                               # a client that closes the stream mid-response
                call.cancel()
                seen["hung up mid-response"] += 1
                return
            kind = msg.WhichOneof("body")
            if kind == "chunk":
                chunks[msg.request_id] += 1
            elif kind == "error":
                code = CODES.get(msg.error.code)
                assert code in ALLOWED, f"{code}: {msg.error.message}"
                assert msg.error.message
                seen[f"request {code.name}"] += 1
            elif kind == "done":
                if msg.request_id in sent:
                    assert msg.done.num_chunks == chunks[msg.request_id], (msg.done.num_chunks, chunks)
                    if not sent[msg.request_id].texts:
                        want = sum(int(np.prod(t.shape)) for t in sent[msg.request_id].sequences)
                        assert msg.done.num_tokens == want, (msg.done.num_tokens, want)
                    seen["done checked"] += 1
                seen["request done"] += 1
        seen["stream OK"] += 1
    except grpc.RpcError as e:
        ok = (hang_up and e.code() == grpc.StatusCode.CANCELLED) or e.code() in ALLOWED - {DEADLINE}
        assert ok, (e.code(), e.details())
        seen[f"stream {e.code().name}"] += 1


def _kserve_exchange(stub, req, seen: Counter) -> None:
    try:
        stub.ModelInfer(req, timeout=30)
        seen["kserve OK"] += 1
    except grpc.RpcError as e:
        ours = e.code() == DEADLINE and (e.details() or "").startswith("timeout_s:")   # the request's own deadline
        assert ours or e.code() in KSERVE_ALLOWED - {DEADLINE}, (e.code(), e.details())   # the client's: a hang
        assert e.details() and "Traceback" not in e.details() and len(e.details()) < 1000, e.details()
        seen[f"kserve {e.code().name}"] += 1


def _run(fuzz_server, reference, examples: int, kserve_examples: int = 0) -> None:
    server, stub = fuzz_server
    proc = psutil.Process(server.proc.pid)
    proc = (proc.children() or [proc])[0]       # under --tp the ranks are children of the launcher: rank 0
    rss0, peak, seen = proc.memory_info().rss, 0, Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(stream=streams())
    def one(stream):
        nonlocal peak
        reqs, hang_up = stream
        seen["cases"] += 1
        seen["requests"] += len(reqs)
        _exchange(stub, reqs, hang_up, seen)
        if seen["cases"] % 20 == 0:
            peak = max(peak, proc.memory_info().rss)

    one()
    if kserve_examples:
        with grpc.insecure_channel(server.address) as ch:
            kstub = kpb_grpc.GRPCInferenceServiceStub(ch)

            @settings(max_examples=kserve_examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(req=kserve_requests())
            def kone(req):
                seen["kserve cases"] += 1
                _kserve_exchange(kstub, req, seen)

            kone()
        assert seen["kserve OK"] > 0
    assert server.proc.poll() is None, "the server died"
    assert seen["request done"] > 0                               # well-formed fuzzed requests really ran
    assert seen["done checked"] > 0                               # ... and their chunk counts were checked
    seq = np.array([1, 5, 9, 200, 31, 7])
    with TeacherClient(server.address) as c:                    # still serving, and right
        lp = c.logprobs([seq])[0]
    np.testing.assert_allclose(lp, ref_token_logprobs(reference.logits(seq), seq), atol=1e-5)
    end = proc.memory_info().rss
    peak = max(peak, end)
    print(f"\nfuzz: {seen['cases']} streams, {seen['requests']} messages; crashes 0; outcomes "
          f"{dict(sorted((k, v) for k, v in seen.items() if k not in ('cases', 'requests')))}; server RSS start "
          f"{rss0 >> 20} MiB, peak {peak >> 20} MiB, end {end >> 20} MiB")
    assert peak - rss0 < 300 << 20, f"server RSS grew {(peak - rss0) >> 20} MiB over {examples} malformed streams"


@pytest.mark.live_server
def test_fuzzed_requests_get_clear_statuses(fuzz_server, llama_ref):
    _run(fuzz_server, llama_ref, 300, kserve_examples=300)


@pytest.fixture(scope="module")
def fuzz_server_tp2(model_dirs):
    """The same at TP 2: a malformed request must never take a multi-rank server down."""
    server = CliServer("--model", str(model_dirs["llama"]), "--logprob-chunk-size", "16", "--tp", "2")
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.LogitServeStub(channel)
    channel.close()
    assert server.stop() == 0


@pytest.mark.multi_process
def test_fuzzed_requests_at_tp2(fuzz_server_tp2, llama_ref):
    _run(fuzz_server_tp2, llama_ref, 100, kserve_examples=150)


@pytest.mark.live_server
@pytest.mark.slow
def test_ten_thousand_fuzzed_requests(fuzz_server, llama_ref):
    _run(fuzz_server, llama_ref, 10_000, kserve_examples=10_000)
