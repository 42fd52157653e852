"""Several teachers from one client: rows routed by teacher id to two served models with different vocabularies,
answers exact against float64 transformers in input order, every teacher asked at once; mixture losses against
float64 references, and a student trained through a mixture of a same-vocabulary and a cross-tokenizer teacher."""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading

import grpc
import numpy as np
import pytest
import torch

from helpers import Reference, assert_close, assert_same_signature, build_model, ref_token_logprobs, serve_dir
from logitserve.client import AsyncTeacherClient, LogitServeError, TeacherClient, Teachers, Wanted
from logitserve.client.align import align_by_byte_offsets, token_byte_offsets
from logitserve.client.distill import full_kd_loss, kd_loss, mixture_kd_loss, mixture_loss, routed_batches
from logitserve.client.gold import gold_loss
from logitserve.client.teachers import AsyncTeachers

WORDS_VOCAB = 203          # word-level: "t3".."t202" (the demo tokenizer's scheme)
CORPUS = [" ".join(f"t{i}" for i in np.random.default_rng(s).integers(3, 40, 12)) for s in range(40)]


def _byte_level_tokenizer():
    """A byte-level BPE trained on CORPUS: another vocabulary and other token boundaries than the words'."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])   # a BOS
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


@pytest.fixture(scope="module")
def teachers_served(tmp_path_factory):
    """Two served teachers: "words" (Llama, word-level tokenizer, V 203) and "bytes" (Qwen 2, byte-level BPE)."""
    from logitserve.demo import demo_tokenizer

    root = tmp_path_factory.mktemp("teachers")
    words_tok, bytes_tok = demo_tokenizer(WORDS_VOCAB), _byte_level_tokenizer()
    dirs = {"words": build_model(root / "words", "llama", vocab=WORDS_VOCAB, hidden=32, seed=1),
            "bytes": build_model(root / "bytes", "qwen2", vocab=len(bytes_tok), hidden=32, seed=2)}
    words_tok.save_pretrained(dirs["words"])
    bytes_tok.save_pretrained(dirs["bytes"])
    servers = {name: serve_dir(d) for name, d in dirs.items()}
    yield dict(dirs=dirs, servers=servers, tokenizers={"words": words_tok, "bytes": bytes_tok})
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def references(teachers_served):
    return {name: Reference(d) for name, d in teachers_served["dirs"].items()}


def _clients(served, **options):
    return Teachers({name: TeacherClient(s.address, **options) for name, s in served["servers"].items()})


ROUTE = ["words", "bytes", "bytes", "words", "bytes", "words"]


@pytest.mark.live_server
def test_rows_routed_by_teacher_match_float64_in_input_order(teachers_served, references):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 200, n) for n in (9, 14, 5, 20, 11, 7)]
    prompts = [1, 4, 2, 6, 1, 3]
    cands = [rng.integers(0, 200, (len(s) - p, 3)) for s, p in zip(seqs, prompts)]
    with _clients(teachers_served) as teachers:
        r = teachers.forward(seqs, ROUTE, logprobs=True, topk=6, topk_as_logprobs=True, candidates=cands,
                             prompt_lengths=prompts)
        widths = [z.shape[1] for z in teachers.full_logits(seqs[:2], ROUTE[:2])]
        lp = teachers.logprobs(seqs, np.array(ROUTE))                    # a numpy array of ids routes alike
    assert r.teacher == tuple(ROUTE) and set(r.results) == {"words", "bytes"}
    bytes_vocab = len(teachers_served["tokenizers"]["bytes"])
    assert 256 < bytes_vocab != WORDS_VOCAB
    assert r.model is None and {x.model.vocab_size for x in r.results.values()} == {WORDS_VOCAB, bytes_vocab}
    assert widths == [WORDS_VOCAB, bytes_vocab]                          # the two vocabularies really differ
    for i, (seq, p, t) in enumerate(zip(seqs, prompts, ROUTE)):
        z = references[t].logits(seq)                                    # [L, V_t] float64
        lsm = torch.log_softmax(z, -1)[p - 1 : len(seq) - 1]             # rows predicting tokens p..L-1
        assert_close(r.logprobs[i], ref_token_logprobs(z, seq)[p:])
        assert_close(r.topk_values[i], torch.sort(lsm, -1, descending=True).values[:, :6].numpy())
        assert_close(r.candidate_logprobs[i], lsm.gather(-1, torch.as_tensor(cands[i])).numpy())
        assert_close(lp[i], ref_token_logprobs(z, seq))


@pytest.mark.live_server
def test_async_teachers_route_alike(teachers_served, references):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 200, n) for n in (6, 13, 8)]
    route = ["bytes", "words", "bytes"]

    async def main():
        clients = {name: AsyncTeacherClient(s.address) for name, s in teachers_served["servers"].items()}
        async with AsyncTeachers(clients) as teachers:
            return await teachers.logprobs(seqs, route)
    got = asyncio.run(main())
    for g, seq, t in zip(got, seqs, route):
        assert_close(g, ref_token_logprobs(references[t].logits(seq), seq))


class _Gated:
    """A TeacherClient whose answers wait until every gated client has been sent its request: a router that
    waits for one teacher before asking the next never gets past the barrier."""

    def __init__(self, client: TeacherClient, barrier: threading.Barrier):
        self.client, self.barrier, self.pool = client, barrier, concurrent.futures.ThreadPoolExecutor(1)

    def submit(self, seqs, wanted, bf16_as_torch=False):
        real = self.client.submit(seqs, wanted, bf16_as_torch)

        def answer():
            self.barrier.wait(timeout=10)
            return real.result()
        return self.pool.submit(answer)


@pytest.mark.live_server
def test_every_teacher_is_asked_before_any_answer_is_awaited(teachers_served):
    assert_same_signature(_Gated.submit, TeacherClient.submit)
    barrier = threading.Barrier(2)
    with _clients(teachers_served) as plain:
        gated = Teachers({name: _Gated(c, barrier) for name, c in plain.items()})
        got = gated.logprobs([[1, 2, 3], [4, 5, 6, 7]], ["words", "bytes"])
        assert [len(x) for x in got] == [3, 4]


@pytest.mark.live_server
def test_bad_routing_names_the_row_and_a_teachers_error_names_the_teacher(teachers_served):
    with _clients(teachers_served) as teachers:
        with pytest.raises(ValueError, match=r"teacher\[1\]='code': not one of the teachers \['bytes', 'words'\]"):
            teachers.logprobs([[1, 2], [3, 4]], ["words", "code"])
        with pytest.raises(ValueError, match="teacher: one id per sequence is needed, 1 ids given for 2"):
            teachers.logprobs([[1, 2], [3, 4]], ["words"])
        with pytest.raises(LogitServeError) as e:                        # id 250 is in bytes' vocabulary only
            teachers.logprobs([[1, 250], [1, 250]], ["bytes", "words"])
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith("teacher 'words': ")
        assert len(teachers.logprobs([[1, 250]], ["bytes"])[0]) == 2        # the clients still work

    async def mixed():
        c = AsyncTeacherClient("127.0.0.1:1")
        try:
            with pytest.raises(TypeError, match=r"clients\['a'\]: AsyncTeacherClient is not a blocking client; use "
                                                r"AsyncTeachers"):
                Teachers({"a": c})
        finally:
            await c.close()
    asyncio.run(mixed())


def _kl_rows(p_log: list, q_log: list) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(p_log, q_log) if a > -math.inf)


@pytest.mark.unit
def test_mixture_kd_loss_matches_float64_loops():
    """Teacher a covers rows (0, *) and (1, *), b covers (1, *) and (2, *): row 1 is an ensemble of both."""
    gen = torch.Generator().manual_seed(3)
    B, L, V = 3, 5, 30
    z = (torch.randn(B, L, V, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    batches, w = {}, {"a": 0.7, "b": 0.4}
    from logitserve.client.distill import TeacherBatch
    for t, k, rows in (("a", 4, [0, 1]), ("b", 6, [1, 2])):
        ids = torch.stack([torch.randperm(V, generator=gen)[:k] for _ in range(B * L)]).reshape(B, L, k)
        vals = torch.randn(B, L, k, generator=gen, dtype=torch.float64)
        mask = torch.zeros(B, L, dtype=torch.bool)
        mask[rows] = True
        batches[t] = TeacherBatch(vals, ids, mask)
    loss = mixture_kd_loss(z, batches, w, kl="forward", tail="renormalize")
    total, count = 0.0, 0
    for b in range(B):
        for pos in range(L):
            covered = [t for t in batches if batches[t].mask[b, pos]]
            count += bool(covered)
            for t in covered:
                ids = batches[t].ids[b, pos].tolist()
                s = [float(z[b, pos, i].detach()) for i in ids]
                v = batches[t].values[b, pos].tolist()
                ls, lv = math.log(sum(map(math.exp, s))), math.log(sum(map(math.exp, v)))
                total += w[t] * _kl_rows([x - lv for x in v], [x - ls for x in s])
    assert abs(loss.item() - total / count) <= 1e-12
    loss.backward()
    assert torch.all(z.grad[0].abs().sum(-1) > 0) and torch.all(z.grad[2].abs().sum(-1) > 0)
    with pytest.raises(ValueError, match=r"weights: teachers \['a', 'b'\] need one weight each, got \['a'\]"):
        mixture_kd_loss(z, batches, {"a": 1.0})
    with pytest.raises(ValueError, match=r"weights\['b'\]=-1"):
        mixture_loss({"a": loss, "b": loss}, {"a": 1.0, "b": -1})


@pytest.mark.unit
def test_weighted_forward_kls_have_the_gradient_of_the_kl_to_the_mixture():
    """Why mixture_loss sums losses: with forward KL its gradient equals that of KL(sum_t w_t p_t || q), and the
    two differ by the teachers' Jensen gap, a constant in the student (checked in float64)."""
    gen = torch.Generator().manual_seed(5)
    B, L, V = 2, 4, 25
    z = torch.randn(B, L, V, generator=gen, dtype=torch.float64, requires_grad=True)
    teachers = {t: torch.randn(B, L, V, generator=gen, dtype=torch.float64) * 2 for t in ("a", "b", "c")}
    w = {"a": 0.5, "b": 0.3, "c": 0.2}
    ours = mixture_loss({t: full_kd_loss(z, zt, kind="forward") for t, zt in teachers.items()}, w)
    (g_ours,) = torch.autograd.grad(ours, z)
    p = {t: torch.softmax(zt, -1) for t, zt in teachers.items()}
    mix = sum(w[t] * p[t] for t in p)                                   # [B, L, V]
    q_log = torch.log_softmax(z, -1)
    to_mix = (mix * (mix.log() - q_log)).sum(-1).mean()
    (g_mix,) = torch.autograd.grad(to_mix, z)
    assert torch.allclose(g_ours, g_mix, atol=1e-12, rtol=0)
    gap = (sum(w[t] * (p[t] * p[t].log()).sum(-1) for t in p) - (mix * mix.log()).sum(-1)).mean()
    assert gap.item() > 1e-3 and abs((ours - to_mix).item() - gap.item()) <= 1e-12


@pytest.mark.live_server
def test_student_loss_falls_under_a_mixture_of_a_same_and_a_cross_vocabulary_teacher(teachers_served):
    """The student reads bytes as the "bytes" teacher does (top-k KD with the tail bucket), and learns from the
    word-level "words" teacher through the byte-offset alignment (ULD): each text asked of both teachers in one
    routed request."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(teachers_served["dirs"]["bytes"])     # as the teacher's server loads it
    texts = CORPUS[:4]
    n = len(texts)
    with _clients(teachers_served) as teachers:
        r = teachers.forward(texts * 2, ["bytes"] * n + ["words"] * n, topk=16, topk_as_logprobs=True,
                             topk_tail=True, full_logits=True, input_offsets=True)
    student_side = [token_byte_offsets(tok, t, add_special_tokens=True) for t in texts]
    for (ids, offsets), served_ids, served_off in zip(student_side, r.input_ids[:n], r.input_offsets[:n]):
        assert np.array_equal(ids, served_ids) and np.array_equal(offsets, served_off)   # one vocabulary
    length = max(len(ids) for ids, _ in student_side)
    ids = torch.zeros(n, length, dtype=torch.long)
    for b, (x, _) in enumerate(student_side):
        ids[b, : len(x)] = torch.from_numpy(x)
    same_vocab = routed_batches(r, length=length)["bytes"]             # [2n, L, 16]: the first n rows are its
    mask = same_vocab.mask[:n].clone()
    for b, (x, _) in enumerate(student_side):
        mask[b, len(x) - 1 :] = False                                   # row t predicts t + 1: the last predicts none
    assert not same_vocab.mask[n:].any()
    pairs = [align_by_byte_offsets(off[1:], r.input_offsets[n + b][1:]) for b, (_, off) in enumerate(student_side)]

    torch.manual_seed(0)
    student = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits = student(ids).logits                                    # [n, L, V]
        same = kd_loss(logits, same_vocab.values[:n], same_vocab.ids[:n], kl="forward", tail="bucket",
                       teacher_tail=same_vocab.tail[:n], mask=mask)
        cross = torch.stack([gold_loss(logits[b, : len(x) - 1], torch.from_numpy(r.full_logits[n + b][:-1]),
                                       x[1:], r.input_ids[n + b][1:], pairs[b])
                             for b, (x, _) in enumerate(student_side)]).mean()
        loss = mixture_loss({"bytes": same, "words": cross}, {"bytes": 0.5, "words": 0.5})
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append((loss.item(), same.item(), cross.item()))
    first, last = losses[0], losses[-1]
    assert last[0] < 0.9 * first[0] and last[1] < 0.5 * first[1] and last[2] < 0.95 * first[2], losses
