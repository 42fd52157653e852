"""Cross-tokenizer alignment: a student's and the teacher's tokens of one text, grouped into spans that end at a
common UTF-8 byte boundary (TRL GOLD's `_align_by_byte_offsets`); numpy only.

Offsets are [L, 2] UTF-8 byte spans [start, end) of each token in the text: the teacher's
come from the server (`forward(texts, input_offsets=True)`), the student's from
`token_byte_offsets` with its own tokenizer. Only ends matter: tokens are consumed on
both sides until their ends meet; a zero-width token (a BOS at [0, 0)) joins the group
that follows it.
"""
from __future__ import annotations

import numpy as np

from logitserve.tokens import token_byte_spans


def token_byte_offsets(tokenizer, text: str, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(ids [L] int64, offsets [L, 2] int32) of `text` under a transformers fast tokenizer, offsets in UTF-8 bytes
    (byte-level BPE tokens that split one character get consecutive parts of it, as the server's)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    return ids, token_byte_spans(tokenizer, text, ids, enc["offset_mapping"])


def align_by_byte_offsets(student: np.ndarray, teacher: np.ndarray) -> list[tuple[range, range]]:
    """Pairs (student tokens, teacher tokens), consecutive index ranges whose last tokens end at the same byte.

    student [Ls, 2], teacher [Lt, 2] byte spans (ends non-decreasing). Tokens left over at the end (no common
    boundary after them) form one last pair; a pair with an empty side is dropped, as GOLD's caller does.
    """
    s_end, t_end = np.asarray(student)[:, 1], np.asarray(teacher)[:, 1]
    pairs: list[tuple[range, range]] = []
    s = t = s0 = t0 = 0
    while s < len(s_end) and t < len(t_end):
        if s_end[s] < t_end[t]:
            s += 1
        elif s_end[s] > t_end[t]:
            t += 1
        else:
            s, t = s + 1, t + 1
            pairs.append((range(s0, s), range(t0, t)))
            s0, t0 = s, t
    if s0 < len(s_end) or t0 < len(t_end):
        pairs.append((range(s0, len(s_end)), range(t0, len(t_end))))
    return [(a, b) for a, b in pairs if len(a) and len(b)]


def shared_vocabulary(student_vocab: dict, teacher_vocab: dict) -> tuple[np.ndarray, np.ndarray]:
    """(teacher ids, student ids) of the tokens both vocabularies spell identically (`get_vocab()` strings, as
    GOLD matches them), by ascending teacher id."""
    pairs = sorted((t, student_vocab[name]) for name, t in teacher_vocab.items() if name in student_vocab)
    t_ids = np.asarray([t for t, _ in pairs], dtype=np.int64)
    s_ids = np.asarray([s for _, s in pairs], dtype=np.int64)
    return t_ids, s_ids
