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
