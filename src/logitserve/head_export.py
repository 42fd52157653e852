"""The causal LM's head as a student needs it to rebuild the served logits from hidden states: rows and a hash.

At tp = 1 the rows come from the loaded head itself. Under TP rank 0 holds only its
vocab shard, so the rows are read from the checkpoint the shards came from, with the
same reads and the same dtype conversion (`loading._vocab_rows`): what is sent is
bitwise what the ranks multiply with. Padding rows (tp not dividing V) are never sent.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from .loaded import LoadedModel
from .spec import ModelKind


def accumulates_fp32(weight: torch.Tensor) -> bool:
    """Whether the head's logits never pass through a type narrower than fp32 (Engine.logits): fp32 weights,
    or bf16/fp16 ones on a device with an fp32-output GEMM."""
    if weight.dtype == torch.float32:
        return True
    from .capabilities import probe

    return probe(str(weight.device)).mm_out_dtype


@dataclass(frozen=True)
class HeadMeta:
    """What turns a hidden state into the served logits, besides the weight (proto HeadInfo)."""

    vocab_size: int
    hidden_size: int
    dtype: torch.dtype          # the weight's (and bias's)
    has_bias: bool
    logits_fp32: bool           # False: logits rounded to `dtype` before the fp32 post-processing
    multiply: float
    divide: float
    softcap: float              # 0: none
    tied: bool


class HeadSource:
    """Rows of the served lm_head, in its dtype, on the host; and the blake2b of all of them (computed once)."""

    def __init__(self, loaded: LoadedModel):
        if loaded.kind is not ModelKind.CAUSAL_LM:
            raise ValueError("a reward model has no lm_head to send")
        head = loaded.head
        V = loaded.vocab_size
        self._whole = head.out_features >= V        # this rank holds every row (tp = 1); else rank 0's vocab shard
        if not self._whole and loaded.head_checkpoint is None:
            raise ValueError("a vocab-sharded head needs the checkpoint it was read from (head_checkpoint)")
        t = loaded.transform
        emb = loaded.model.get_input_embeddings()
        tied = bool(getattr(loaded.model.config, "tie_word_embeddings", False)) or (
            emb is not None and getattr(emb, "weight", None) is head.weight)
        self.meta = HeadMeta(V, int(head.in_features), head.weight.dtype, head.bias is not None and self._whole,
                             accumulates_fp32(head.weight), t.multiply, t.divide, float(t.softcap or 0.0), tied)
        self._loaded = loaded
        self._hash: Optional[str] = None
        self._checkpoint = None                  # the checkpoint a vocab-sharded head's rows are read from, once
        self._lock = threading.Lock()

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Weight rows [a, b), contiguous on the host in the served dtype. [b - a, H]"""
        if self._whole:
            return self._loaded.head.weight[a:b].detach().to("cpu").contiguous()
        directory, key = self._loaded.head_checkpoint
        if self._checkpoint is None:             # an FP8 checkpoint's scales too: a quantized head is read dequantized
            from .checkpoint import Checkpoint
            from .quant import scheme_of

            self._checkpoint = Checkpoint(directory, scheme_of(getattr(self._loaded.model.config,
                                                                       "quantization_config", None)))
        return self._checkpoint.read_rows(key, a, b).to(self.meta.dtype).contiguous()

    def bias(self) -> Optional[torch.Tensor]:
        """The bias [V] on the host, or None."""
        if not self.meta.has_bias:
            return None
        return self._loaded.head.bias[: self.meta.vocab_size].detach().to("cpu").contiguous()

    def bands(self, band_rows: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows) of the weight, band_rows at a time."""
        V = self.meta.vocab_size
        for a in range(0, V, band_rows):
            yield a, self.rows(a, min(a + band_rows, V))

    def head_hash(self, band_rows: int = 4096) -> str:
        """"blake2b:" + hex over the weight's bytes row-major, then the bias's; once, however many callers."""
        with self._lock:
            if self._hash is None:
                h = hashlib.blake2b(digest_size=16)
                for _, rows in self.bands(band_rows):
                    h.update(tensor_bytes(rows))
                bias = self.bias()
                if bias is not None:
                    h.update(tensor_bytes(bias))
                self._hash = "blake2b:" + h.hexdigest()
            return self._hash


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous host tensor's raw little-endian bytes (bf16 through a 2-byte integer view)."""
    view = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return memoryview(view.numpy()).cast("B")
