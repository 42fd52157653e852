"""Every bad input of SPEC.md's list gets its status and a message naming field and bound; the server keeps serving."""
from __future__ import annotations

import grpc
import numpy as np
import pytest

from helpers import VOCAB, ref_token_logprobs
from logitserve.client import LogitServeError
from logitserve.v1 import logitserve_pb2 as pb
from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

pytestmark = pytest.mark.live_server

GOOD = [5, 9, 77, 300]
MAX_LEN = 512

BAD_CALLS = {
    "id_over_vocab": (lambda c: c.logprobs([[1, 2, VOCAB]]), ["sequences[0][2]", str(VOCAB), f"[0, {VOCAB})"]),
    "negative_id": (lambda c: c.logprobs([[1, 2], [3, -1]]), ["sequences[1][1]", "-1"]),
    "empty_sequence": (lambda c: c.logprobs([[1], []]), ["sequences[1]", "empty"]),
    "too_long": (lambda c: c.logprobs([[1] * (MAX_LEN + 1)]), ["sequences[0]", str(MAX_LEN + 1), str(MAX_LEN)]),
    "no_sequences": (lambda c: c.logprobs([]), ["sequences", "at least one"]),
    "k_zero": (lambda c: c.topk([GOOD], 0), ["topk.k", "0", f"[1, {VOCAB}]"]),
    "k_over_vocab": (lambda c: c.topk([GOOD], VOCAB + 1), ["topk.k", str(VOCAB + 1), f"[1, {VOCAB}]"]),
    "temperature_zero": (lambda c: c.logprobs([GOOD], temperature=0.0), ["temperature", "> 0"]),
    "temperature_negative": (lambda c: c.logprobs([GOOD], temperature=-1.0), ["temperature", "> 0"]),
    "temperature_nan": (lambda c: c.logprobs([GOOD], temperature=float("nan")), ["temperature", "> 0"]),
    "top_p_zero": (lambda c: c.logprobs([GOOD], top_p=0.0), ["logprobs.top_p", "(0, 1]"]),
    "top_p_over_one": (lambda c: c.logprobs([GOOD], top_p=1.5), ["logprobs.top_p", "1.5", "(0, 1]"]),
    "top_k_filter_zero": (lambda c: c.logprobs([GOOD], top_k=0), ["logprobs.top_k", f"[1, {VOCAB}]"]),
    "slice_past_sequence": (lambda c: c.full_logits([GOOD], seq_range=(0, 5)), ["full_logits.seq_start/seq_end", "[0, 4)"]),
    "slice_empty": (lambda c: c.full_logits([GOOD], seq_range=(2, 2)), ["full_logits.seq_start/seq_end"]),
    "slice_past_vocab": (lambda c: c.full_logits([GOOD], vocab_range=(10, VOCAB + 1)),
                         ["full_logits.vocab_start/vocab_end", f"[0, {VOCAB})"]),
    "slice_negative": (lambda c: c.full_logits([GOOD], vocab_range=(-1, 3)), ["full_logits.vocab_start/vocab_end"]),
    "candidates_shape": (lambda c: c.candidate_logprobs([GOOD], [np.zeros((3, 2), int)]), ["candidates.ids[0]", "[L=4, c]"]),
    "candidates_count": (lambda c: c.candidate_logprobs([GOOD, GOOD], [np.zeros((4, 2), int)]), ["candidates.ids", "one per sequence"]),
    "candidate_id_over_vocab": (lambda c: c.candidate_logprobs([GOOD], [np.full((4, 2), VOCAB)]),
                                ["candidates.ids[0][0][0]", f"[0, {VOCAB})"]),
    "scores_on_causal_lm": (lambda c: c.scores([GOOD]), ["scores", "reward"]),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_input_gets_invalid_argument_naming_field_and_bound(client, llama_ref, name):
    call, phrases = BAD_CALLS[name]
    with pytest.raises(LogitServeError) as e:
        call(client)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    for phrase in phrases:
        assert phrase in e.value.details, (phrase, e.value.details)
    # the same client, stream and server still answer a good request correctly
    got = client.logprobs([GOOD])[0]
    np.testing.assert_allclose(got, ref_token_logprobs(llama_ref.logits(GOOD), GOOD), atol=1e-5)


def _raw_stream(address: str, requests: list) -> list:
    with grpc.insecure_channel(address) as channel:
        return list(pb_grpc.LogitServeStub(channel).Forward(iter(requests), timeout=60))


def _seq(ids) -> pb.Tensor:
    return pb.Tensor(dtype=pb.INT32, shape=[len(ids)], data=np.asarray(ids, "<i4").tobytes())


def _good(rid: str) -> pb.ForwardRequest:
    req = pb.ForwardRequest(request_id=rid, sequences=[_seq(GOOD)])
    req.logprobs.SetInParent()
    return req


def _errors_and_dones(responses) -> tuple[dict, set]:
    errors = {r.request_id: r.error for r in responses if r.WhichOneof("body") == "error"}
    done = {r.request_id for r in responses if r.WhichOneof("body") == "done"}
    return errors, done


@pytest.mark.parametrize("mutate,phrases", [
    (lambda r: setattr(r.topk, "dtype", 7) or setattr(r.topk, "k", 3), ["topk.dtype", "unknown wire dtype 7"]),
    (lambda r: setattr(r.full_logits, "dtype", 9), ["full_logits.dtype", "unknown wire dtype 9"]),
    (lambda r: r.sequences[0].MergeFrom(pb.Tensor(data=b"\x01\x02\x03")), ["sequences[0]", "bytes"]),
    (lambda r: setattr(r.sequences[0], "dtype", pb.FLOAT32), ["sequences[0]", "INT32"]),
    (lambda r: r.ClearField("logprobs"), ["outputs", "no output requested"]),
    (lambda r: setattr(r, "request_id", "x" * 300), ["request_id", "256"]),
])
def test_malformed_wire_fields_fail_only_their_request(llama_server, mutate, phrases):
    bad = _good("bad")
    mutate(bad)
    errors, done = _errors_and_dones(_raw_stream(llama_server.address, [_good("a"), bad, _good("b")]))
    bad_id = bad.request_id
    assert set(errors) == {bad_id} and done == {"a", "b"}
    assert errors[bad_id].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for phrase in phrases:
        assert phrase in errors[bad_id].message


def test_duplicate_request_id_in_flight_is_refused(llama_server):
    long = pb.ForwardRequest(request_id="same", sequences=[_seq(list(range(1, 400)))])
    long.full_logits.SetInParent()
    responses = _raw_stream(llama_server.address, [long, _good("same"), _good("other")])
    errors, done = _errors_and_dones(responses)
    assert "same" in done and "other" in done
    assert errors["same"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "already in flight" in errors["same"].message


def test_client_refuses_ids_that_do_not_fit_int32(client):
    with pytest.raises(ValueError, match="int32"):
        client.logprobs([[1, 2 ** 40]])
    with pytest.raises(TypeError, match="integers"):
        client.logprobs([[1.5, 2.0]])
