"""The model's own tokenizer, for requests that carry text: loaded offline from the model directory, once."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .tokens import token_byte_spans, tokenizer_hash

from .errors import InvalidRequest, NotSupported, TooLarge

log = logging.getLogger("logitserve.tokenizing")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


@dataclass(frozen=True)
class TextEncoder:
    tokenizer: object          # a transformers tokenizer
    hash: str                  # logitserve.client.tokenizer_hash of it

    def encode(self, texts: Sequence[str], add_special_tokens: bool = True, offsets: bool = False):
        """int32 [L_i] ids per text; a text that gives no ids is refused naming it. With `offsets`:
        (ids, offsets), offsets int32 [L_i, 2] each token's UTF-8 byte span [start, end) in its text."""
        if offsets and not getattr(self.tokenizer, "is_fast", False):
            raise NotSupported("input_offsets", f"{type(self.tokenizer).__name__} is not a fast tokenizer: it has "
                                                f"no offsets")
        enc = self.tokenizer(list(texts), add_special_tokens=add_special_tokens, return_offsets_mapping=offsets)
        out = tuple(np.asarray(x, dtype=np.int32) for x in enc["input_ids"])
        for i, x in enumerate(out):
            if x.size == 0:
                raise InvalidRequest(f"texts[{i}]", "tokenizes to no ids; a text must give at least one token")
        if not offsets:
            return out
        return out, tuple(token_byte_spans(self.tokenizer, t, x, o)
                          for t, x, o in zip(texts, out, enc["offset_mapping"]))


MAX_DETOKENIZE = 1 << 16      # ids per Detokenize call (gRPC) or POST /detokenize (HTTP)


def check_detokenize_count(count: int, field: str = "ids") -> None:
    """TooLarge for more ids than MAX_DETOKENIZE; checked on the count a request declares, before any conversion."""
    if count > MAX_DETOKENIZE:
        raise TooLarge(f"{field}: {count} ids is over the limit of {MAX_DETOKENIZE} per call; send them in parts")


def detokenize(encoder: TextEncoder, ids: Sequence[int], vocab_size: int) -> tuple[list[str], list[str], int]:
    """(vocabulary entries, each id decoded alone, unk id or -1); the count, then each id against [0, V) first."""
    check_detokenize_count(len(ids))
    ids = list(ids)
    for i, x in enumerate(ids):
        if not 0 <= x < vocab_size:
            raise InvalidRequest(f"ids[{i}]", f"{x} is outside [0, {vocab_size})")
    tok = encoder.tokenizer
    tokens = [t if t is not None else "" for t in tok.convert_ids_to_tokens(list(ids))]
    texts = [tok.decode([x]) for x in ids]
    unk = tok.unk_token_id
    return tokens, texts, -1 if unk is None else int(unk)


def load_tokenizer(directory: Path) -> Optional[TextEncoder]:
    """The directory's tokenizer, or None where it ships none (requests must then carry ids)."""
    if not any((Path(directory) / f).exists() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:        # a broken tokenizer must not stop a server that serves ids
        log.warning("%s: tokenizer files present but not loadable (%s); text requests are refused", directory, e)
        return None
    return TextEncoder(tok, tokenizer_hash(tok))
