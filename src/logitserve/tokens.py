"""The tokenizer hash ModelInfo reports (defined in the proto): plain Python on any tokenizer object, no torch."""
from __future__ import annotations

import hashlib

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
