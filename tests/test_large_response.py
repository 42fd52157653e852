"""A full-vocab response far over 64 MiB arrives in chunks under 4 MiB that a stock client accepts."""
from __future__ import annotations

import pytest
import grpc
import numpy as np

from helpers import Reference, build_model, serve_dir
from logitserve.client import TeacherClient
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.live_server

V, L = 32000, 600   # [600, 32000] fp32 = 73 MiB


def test_full_vocab_response_over_64mib_arrives_in_4mib_chunks(tmp_path):
    directory = build_model(tmp_path / "wide", "llama", vocab=V, hidden=32, layers=1, max_pos=1024)
    server = serve_dir(directory, chunk_size=128)
    seq = np.random.default_rng(0).integers(0, V, L)
    try:
        req = pb.ForwardRequest(request_id="big", sequences=[
            pb.Tensor(dtype=pb.INT32, shape=[L], data=seq.astype("<i4").tobytes())])
        req.full_logits.SetInParent()
        with grpc.insecure_channel(server.address) as channel:   # stock options: 4 MiB receive limit
            responses = list(pb_grpc.LogitServeStub(channel).Forward(iter([req]), timeout=300))
        with TeacherClient(server.address) as c:
            got = c.full_logits([seq])[0]
    finally:
        server.stop()
    chunks = [r for r in responses if r.WhichOneof("body") == "chunk"]
    assert responses[-1].WhichOneof("body") == "done" and responses[-1].done.num_chunks == len(chunks)
    assert sum(len(r.chunk.tensor.data) for r in chunks) == L * V * 4 > 64 << 20
    assert max(r.ByteSize() for r in responses) <= 4 << 20
    assert len(chunks) >= (L * V * 4) // (4 << 20)
    want = Reference(directory).logits(seq, fp32=True).numpy()
    assert got.shape == (L, V) and np.array_equal(got, want)
