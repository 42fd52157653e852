"""The client writes chunks into preallocated arrays and refuses results with missing or doubled elements."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from logitserve.client import LogitServeError
from logitserve.client.assemble import Assembly
from logitserve.v1 import logitserve_pb2 as pb

pytestmark = pytest.mark.unit


def _chunk(r0, r1, c0, c1, full=(4, 6), value=1.0):
    data = np.full((r1 - r0, c1 - c0), value, "<f4")
    return pb.TensorChunk(output=pb.FULL_LOGITS, sequence=0, full_shape=list(full), offset=[r0, c0],
                          tensor=pb.Tensor(dtype=pb.FLOAT32, shape=list(data.shape), data=data.tobytes()))


def _done(n):
    return pb.RequestDone(num_chunks=n, applied=pb.Applied(temperature=1.0))


def test_tiles_reassemble_in_any_order():
    a = Assembly(1, ("full_logits",))
    tiles = [(2, 4, 0, 6), (0, 2, 3, 6), (0, 2, 0, 3)]
    for i, t in enumerate(tiles):
        a.add(_chunk(*t, value=float(i)))
    out = a.finish(_done(3)).full_logits[0]
    want = np.empty((4, 6), np.float32)
    want[2:4], want[0:2, 3:6], want[0:2, 0:3] = 0, 1, 2
    assert np.array_equal(out, want)


@pytest.mark.parametrize("tiles,n,message", [
    ([(0, 2, 0, 6)], 1, "missing"),
    ([(0, 4, 0, 6), (1, 2, 2, 3)], 2, "written twice"),
    ([(0, 3, 0, 6), (2, 4, 0, 6)], 2, "written twice"),
    ([(0, 4, 0, 6)], 2, "chunks"),
])
def test_missing_or_doubled_elements_raise_data_loss(tiles, n, message):
    a = Assembly(1, ("full_logits",))
    for t in tiles:
        a.add(_chunk(*t))
    with pytest.raises(LogitServeError) as e:
        a.finish(_done(n))
    assert e.value.code == grpc.StatusCode.DATA_LOSS and message in e.value.details


def test_chunk_outside_the_output_is_refused():
    with pytest.raises(LogitServeError, match="outside"):
        Assembly(1, ("full_logits",)).add(_chunk(3, 5, 0, 6))


def test_bf16_chunks_become_exact_float32():
    values = np.array([1.0, -2.5, 3.140625, 1e-3], np.float32)
    bits = (values.view(np.uint32) >> 16).astype("<u2")
    chunk = pb.TensorChunk(output=pb.TOKEN_LOGPROBS, sequence=0, full_shape=[4], offset=[0],
                           tensor=pb.Tensor(dtype=pb.BFLOAT16, shape=[4], data=bits.tobytes()))
    a = Assembly(1, ("logprobs",))
    a.add(chunk)
    got = a.finish(_done(1)).logprobs[0]
    assert got.dtype == np.float32
    assert np.array_equal(got, (bits.astype(np.uint32) << 16).view(np.float32))
