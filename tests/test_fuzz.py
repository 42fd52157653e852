"""Hypothesis-made malformed requests against a live server: each gets a clear status (never INTERNAL) or is
ignored, the server never crashes or hangs, memory stays bounded, and a good request afterwards is answered
right. CI runs a few hundred cases; `pytest -m slow tests/test_fuzz.py` runs 10,000."""
from __future__ import annotations

import os

import grpc
import numpy as np
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import serve_dir
from logitserve.client import TeacherClient
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

ALLOWED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
CODES = {c.value[0]: c for c in grpc.StatusCode}

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


@st.composite
def requests(draw):
    req = pb.ForwardRequest(request_id=draw(st.text(max_size=draw(st.sampled_from([8, 300])))))
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


@pytest.fixture(scope="module")
def fuzz_server(model_dirs):
    server = serve_dir(model_dirs["llama"])
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.LogitServeStub(channel)
    channel.close()
    server.stop()


def _exchange(stub, req: pb.ForwardRequest, hang_up: bool) -> None:
    call = stub.Forward(iter([req]), timeout=60)
    try:
        for msg in call:
            if hang_up:                               # a client that closes the stream mid-response
                call.cancel()
                return
            kind = msg.WhichOneof("body")
            if kind == "error":
                code = CODES.get(msg.error.code)
                assert code in ALLOWED, f"{code}: {msg.error.message}"
                assert msg.error.message
            elif kind == "done":
                assert msg.done.num_chunks >= 0
    except grpc.RpcError as e:
        assert hang_up and e.code() == grpc.StatusCode.CANCELLED or e.code() in ALLOWED, (e.code(), e.details())


def _run(fuzz_server, examples: int):
    server, stub = fuzz_server
    rss0 = psutil.Process(os.getpid()).memory_info().rss

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(req=requests(), hang_up=st.booleans())
    def one(req, hang_up):
        _exchange(stub, req, hang_up and not req.cancel)

    one()
    with TeacherClient(server.address) as c:                    # still serving, and right
        lp = c.logprobs([[1, 5, 9, 200]])[0]
    assert lp.shape == (4,) and lp[0] == 0 and np.isfinite(lp).all()
    grown = psutil.Process(os.getpid()).memory_info().rss - rss0
    assert grown < 300 << 20, f"RSS grew {grown >> 20} MiB over {examples} malformed requests"


def test_fuzzed_requests_get_clear_statuses(fuzz_server):
    _run(fuzz_server, 300)


@pytest.mark.slow
def test_ten_thousand_fuzzed_requests(fuzz_server):
    _run(fuzz_server, 10_000)
