"""Cross-tokenizer distillation: the server's byte offsets, the byte-boundary alignment and the ULD / GOLD loss,
each against a hand-written reference, on texts with multi-byte UTF-8, whitespace runs and tokens that straddle
the other tokenizer's boundaries."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import serve_dir
from logitserve.client import TeacherClient
from logitserve.client.align import align_by_byte_offsets, shared_vocabulary, token_byte_offsets
from logitserve.client.gold import gold_loss

CORPUS = ["the café is naïve about 日本語 and 😀 emoji", "double  spaces\tand tabs, straddling-hyphens!",
          "über straße résumé 東京 😀😀 the end", "we distill the teacher's distribution into the student"] * 20
TEXTS = ["the café 日本語 😀! 中文😎Ω", "double  spaces\tstraddle-hyphens über", "résumé 東京😀 the student", "a"]


def _byte_level(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def _word_bpe(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()          # drops whitespace: spans with gaps between them
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def tokenizers():
    return _byte_level(400), _word_bpe(150)


@pytest.fixture(scope="module")
def teacher(tokenizers, tmp_path_factory):
    """A small Llama whose directory ships the byte-level tokenizer, served."""
    import transformers as tf

    directory = tmp_path_factory.mktemp("xtok") / "teacher"
    vocab = len(tokenizers[0])
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, tie_word_embeddings=False)
    torch.manual_seed(4)
    tf.LlamaForCausalLM(cfg).float().eval().save_pretrained(directory, safe_serialization=True)
    tokenizers[0].save_pretrained(directory)
    server = serve_dir(directory)
    yield server
    server.stop()


def _piece_bytes(tok, ids) -> list[bytes]:
    """Each byte-level token's bytes, through the GPT-2 byte <-> unicode table written out here."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + n)] = b
            n += 1
    return [bytes(table[c] for c in piece) for piece in tok.convert_ids_to_tokens(list(ids))]


@pytest.mark.live_server
def test_server_offsets_are_utf8_byte_spans(teacher, tokenizers):
    with TeacherClient(teacher.address) as c:
        r = c.forward(TEXTS, logprobs=True, input_offsets=True, add_special_tokens=False)
    split_chars = 0
    for text, ids, offsets in zip(TEXTS, r.input_ids, r.input_offsets):
        pieces = _piece_bytes(tokenizers[0], ids)
        assert b"".join(pieces) == text.encode()
        ends = np.cumsum([len(p) for p in pieces])
        want = np.stack([ends - [len(p) for p in pieces], ends], 1)
        assert np.array_equal(offsets, want), text
        for p in pieces:          # some token holds part of a character: the split-span case is exercised
            try:
                p.decode()
            except UnicodeDecodeError:
                split_chars += 1
    assert split_chars >= 2


def _reference_groups(s_off, t_off):
    """Every byte both tokenizations end a token at is a boundary; a group is the tokens ending after the previous
    boundary and at or before the next; tokens after the last common boundary form one tail group."""
    common = sorted(set(int(e) for e in s_off[:, 1]) & set(int(e) for e in t_off[:, 1]))
    out, prev = [], -1
    for c in common + [math.inf]:
        sg = [i for i, e in enumerate(s_off[:, 1]) if prev < e <= c]
        tg = [i for i, e in enumerate(t_off[:, 1]) if prev < e <= c]
        if sg and tg:
            out.append((sg, tg))
        prev = c
    return out


@pytest.mark.unit
def test_alignment_matches_reference(tokenizers):
    teacher_tok, student_tok = tokenizers
    straddles = 0
    for text in TEXTS + CORPUS[:4]:
        _, t_off = token_byte_offsets(teacher_tok, text)
        _, s_off = token_byte_offsets(student_tok, text)
        pairs = align_by_byte_offsets(s_off, t_off)
        assert [(list(a), list(b)) for a, b in pairs] == _reference_groups(s_off, t_off), text
        straddles += sum(len(a) > 1 and len(b) > 1 for a, b in pairs)    # neither side's tokens nest in the other's
    assert straddles >= 1
    bos = np.array([[0, 0], [0, 3], [3, 5]])          # a zero-width BOS joins the group after it
    assert align_by_byte_offsets(np.array([[0, 2], [2, 5]]), bos) == [(range(0, 2), range(0, 3))]


def _reference_loss(s_logits, t_logits, s_ids, t_ids, pairs, shared, beta, merge):
    """GOLD per sequence, float64, plain Python loops."""
    s = torch.softmax(s_logits.double(), -1).tolist()
    t = torch.softmax(t_logits.double(), -1).tolist()

    def merged(probs, group, ids):
        keep, rest = (group[-1], group[:-1]) if merge == "bayesian" else (group[0], group[1:])
        f = 1.0
        for j in rest:
            f *= max(probs[j][ids[j]], 1e-8)
        return [p * f for p in probs[keep]]

    S = [merged(s, list(a), s_ids) for a, _ in pairs]
    T = [merged(t, list(b), t_ids) for _, b in pairs]

    def l1_sorted(P, Q):
        total = 0.0
        for p, q in zip(P, Q):
            p, q = sorted(p, reverse=True), sorted(q, reverse=True)
            w = max(len(p), len(q))
            p, q = p + [0.0] * (w - len(p)), q + [0.0] * (w - len(q))
            total += sum(abs(a - b) for a, b in zip(p, q))
        return total / len(P)

    if shared is None:
        return l1_sorted(S, T)
    tm, sm = list(shared[0]), list(shared[1])
    jsd = 0.0
    for p, q in zip(S, T):
        for ti, si in zip(tm, sm):
            ls, lt = math.log(max(p[si], 1e-8)), math.log(max(q[ti], 1e-8))
            m = math.log((1 - beta) * math.exp(ls) + beta * math.exp(lt))
            jsd += beta * math.exp(lt) * (lt - m) + (1 - beta) * math.exp(ls) * (ls - m)
    jsd /= len(S)
    s_rest = [[x for k, x in enumerate(p) if k not in set(sm)] for p in S]
    t_rest = [[x for k, x in enumerate(q) if k not in set(tm)] for q in T]
    w = len(tm) / len(T[0])
    return w * jsd + (1 - w) * l1_sorted(s_rest, t_rest)


@pytest.mark.unit
@pytest.mark.parametrize("merge", ["bayesian", "observed"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_gold_loss_matches_reference(tokenizers, merge, hybrid):
    teacher_tok, student_tok = tokenizers
    shared = shared_vocabulary(student_tok.get_vocab(), teacher_tok.get_vocab()) if hybrid else None
    if hybrid:
        assert 10 < len(shared[0]) < len(student_tok)      # some tokens shared, not all
    gen = torch.Generator().manual_seed(1)
    for text in TEXTS[:3]:
        t_ids, t_off = token_byte_offsets(teacher_tok, text)
        s_ids, s_off = token_byte_offsets(student_tok, text)
        pairs = align_by_byte_offsets(s_off, t_off)
        s_logits = (torch.randn(len(s_ids), len(student_tok), generator=gen, dtype=torch.float64) * 3).requires_grad_()
        t_logits = torch.randn(len(t_ids), len(teacher_tok), generator=gen, dtype=torch.float64) * 3
        loss = gold_loss(s_logits, t_logits, s_ids, t_ids, pairs, shared=shared, beta=0.3, merge=merge)
        ref = _reference_loss(s_logits.detach(), t_logits, s_ids.tolist(), t_ids.tolist(), pairs, shared, 0.3, merge)
        assert abs(loss.item() - ref) <= 1e-10 * max(1.0, abs(ref))
        loss.backward()
        assert torch.isfinite(s_logits.grad).all() and s_logits.grad.abs().sum() > 0
