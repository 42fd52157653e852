"""Tokenizer facts shared by server and client: the hash ModelInfo reports, UTF-8 byte offsets; numpy, no torch."""
from __future__ import annotations

import hashlib

import numpy as np

SPECIAL = ("bos", "eos", "unk", "pad")


def tokenizer_hash(tokenizer) -> str:
    """blake2b over a tokenizer's vocabulary (id order) and its special token ids.

    Takes anything with `get_vocab()` and `<name>_token_id` attributes (transformers tokenizers),
    so a student checks it shares the teacher's vocabulary without loading the teacher's files.
    """
    h = hashlib.blake2b(digest_size=16)
    for token, i in sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0])):
        h.update(f"{i}\t{token}\n".encode())
    for name in SPECIAL:
        value = getattr(tokenizer, f"{name}_token_id", None)
        h.update(f"{name}\t{-1 if value is None else int(value)}\n".encode())
    return "blake2b:" + h.hexdigest()


def byte_offsets(text: str, chars: np.ndarray) -> np.ndarray:
    """Character offsets [L, 2] of `text` as UTF-8 byte offsets, int32 [L, 2]."""
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")                  # [n]
    width = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)                          # [n]
    at = np.concatenate([[0], np.cumsum(width)])                                                    # [n + 1]
    return at[np.clip(chars, 0, len(points))].astype(np.int32)


def split_shared_spans(spans: np.ndarray, piece_bytes: list[int]) -> np.ndarray:
    """Byte-level BPE splits one multi-byte character over several tokens, and the tokenizer gives each of them
    the character's whole span. Where a run of tokens shares one span [s, e) and their pieces' byte lengths add
    up to e - s, each gets its own consecutive part. spans: [L, 2] int32 (a fixed copy)."""
    out = spans.copy()
    i, L = 0, len(spans)
    while i < L:
        j = i + 1
        while j < L and spans[j, 0] == spans[i, 0] and spans[j, 1] == spans[i, 1]:
            j += 1
        s, e = int(spans[i, 0]), int(spans[i, 1])
        if j - i > 1 and e > s and sum(piece_bytes[i:j]) == e - s:
            at = s
            for k in range(i, j):
                out[k] = (at, at + piece_bytes[k])
                at += piece_bytes[k]
        i = j
    return out


def token_byte_spans(tokenizer, text: str, ids, char_offsets) -> np.ndarray:
    """A transformers fast tokenizer's character offsets [L, 2] of `text` as UTF-8 byte spans, int32 [L, 2]; for a
    byte-level BPE (GPT-2, Llama 3, Qwen: each character of a piece stands for one byte) the tokens holding parts
    of one multi-byte character get consecutive parts of its span (split_shared_spans)."""
    spans = byte_offsets(text, np.asarray(char_offsets, dtype=np.int64).reshape(-1, 2))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and "ByteLevel" in repr(backend.pre_tokenizer) + repr(backend.decoder):
        spans = split_shared_spans(spans, [len(p) for p in tokenizer.convert_ids_to_tokens([int(x) for x in ids])])
    return spans
