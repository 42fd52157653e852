"""Text in: the server tokenizes with the model's own tokenizer, returns the ids beside the outputs, and reports
a tokenizer hash that a student computes from its own tokenizer; refusals name the field."""
from __future__ import annotations

import hashlib

import grpc
import numpy as np
import pytest
import torch

from helpers import Reference, VOCAB, assert_close, build_model, ref_token_logprobs, serve_dir
from logitserve.client import LogitServeError, TeacherClient, tokenizer_hash

pytestmark = pytest.mark.live_server

TEXTS = ["t5 t9 t200 t17", "t7 t7 t1000", "t3"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    from logitserve.demo import demo_tokenizer

    directory = build_model(tmp_path_factory.mktemp("text") / "llama", "llama")
    demo_tokenizer(VOCAB).save_pretrained(directory)
    server = serve_dir(directory)
    yield directory, server
    server.stop()


def _hash_by_hand(directory) -> str:
    """The proto's definition, written out with the tokenizer's own vocabulary: the independent reference."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    h = hashlib.blake2b(digest_size=16)
    for token, i in sorted(tok.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{i}\t{token}\n".encode())
    for name in ("bos", "eos", "unk", "pad"):
        i = getattr(tok, f"{name}_token_id")
        h.update(f"{name}\t{-1 if i is None else i}\n".encode())
    return "blake2b:" + h.hexdigest()


def test_model_info_reports_the_tokenizer_hash_a_student_can_compute(text_model):
    from transformers import AutoTokenizer

    from logitserve.demo import demo_tokenizer

    directory, server = text_model
    with TeacherClient(server.address) as c:
        reported = c.model_info().tokenizer_hash
    assert reported == _hash_by_hand(directory)
    assert reported == tokenizer_hash(AutoTokenizer.from_pretrained(directory))
    assert tokenizer_hash(demo_tokenizer(VOCAB + 1)) != reported        # one more token: another vocabulary


def test_texts_are_tokenized_by_the_model_tokenizer_and_outputs_are_over_those_ids(text_model):
    from transformers import AutoTokenizer

    directory, server = text_model
    tok = AutoTokenizer.from_pretrained(directory)
    ref = Reference(directory)
    with TeacherClient(server.address) as c:
        r = c.forward(TEXTS, logprobs=True, topk=5, temperature=0.9)
        bare = c.forward(TEXTS, logprobs=True, add_special_tokens=False)
    for j, text in enumerate(TEXTS):
        want = tok(text)["input_ids"]
        assert want[0] == tok.bos_token_id and r.input_ids[j].dtype == np.int32
        assert r.input_ids[j].tolist() == want
        z = ref.logits(want, 0.9)                                          # [L, V] float64
        assert_close(r.logprobs[j], ref_token_logprobs(z, want))
        assert_close(r.topk_values[j], torch.sort(z, -1, descending=True).values[:, :5].numpy())
        assert bare.input_ids[j].tolist() == tok(text, add_special_tokens=False)["input_ids"]
        assert_close(bare.logprobs[j], ref_token_logprobs(ref.logits(bare.input_ids[j]), bare.input_ids[j]))


def _code(server, seqs, **kw):
    with TeacherClient(server.address) as c:
        with pytest.raises(LogitServeError) as e:
            c.forward(seqs, logprobs=True, **kw)
        c.logprobs([[1, 2, 3]])                       # the stream and the server carry on
    return e.value.code, e.value.details


def test_bad_text_requests_are_refused_naming_the_field(text_model, model_dirs):
    from logitserve.client.wire import Wanted, build_request

    directory, server = text_model
    code, details = _code(server, [""], add_special_tokens=False)          # no BOS: no ids at all
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("texts[0]:")
    code, details = _code(server, ["t5 " * 600])                        # over max_position_embeddings 512
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("texts[0] (tokenized):"), details
    with pytest.raises(TypeError, match="not a mix"):
        build_request("x", ["t5", [1, 2]], Wanted(logprobs=True))
    mixed = build_request("x", ["t5"], Wanted(logprobs=True))
    mixed.sequences.add(dtype=4, shape=[1], data=np.int32([3]).tobytes())
    with pytest.raises(LogitServeError) as e:
        _raw(server, mixed)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "either sequences" in e.value.details
    plain = serve_dir(model_dirs["llama"])                                # no tokenizer in this directory
    try:
        with TeacherClient(plain.address) as c:
            assert c.model_info().tokenizer_hash == ""
        code, details = _code(plain, ["t5 t6"])
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "texts: " in details and "no tokenizer" in details
    finally:
        plain.stop()


def _raw(server, req):
    """One request on a raw stub, its error raised as the client raises it."""
    from logitserve.v1 import logitserve_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server.address) as ch:
        for msg in pb_grpc.LogitServeStub(ch).Forward(iter([req])):
            if msg.HasField("error"):
                raise LogitServeError.from_code(msg.error.code, msg.error.message)
