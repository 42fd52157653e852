"""Estimates a job's peak extra memory before it runs, so the server refuses what can never fit instead of OOMing.

The head runs `chunk` rows at a time. The body runs each sequence alone
(exact mode) or a packed row of up to `pack_tokens` tokens of the batch's
sequences (packed mode), so a job's peak is the body's activations for its
longest sequence or a full pack, whichever is more, plus one chunk's logits
and their temporaries plus the outputs waiting to be sent. The constants are calibrated against measured peak RSS
(tests/test_memory.py checks the estimate stays above what is measured). Activations are in the serving dtype
whatever the weights are: an FP8 GEMM's quantized copy of its input (one byte an element) sits within the
hidden copies counted. `weight_bytes` is what a loaded rank's weights hold, FP8 weights at one byte an element.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import Job

# [rows, width] activations per token held at the body's peak, in hidden / intermediate widths. Measured
# ~8 and ~3 live (demo model, 8192 tokens: 135 MiB); x1.5 for what the allocator keeps after the body returns.
_BODY_HIDDEN_COPIES = 12
_BODY_MLP_COPIES = 5
# fp32 [chunk, V/tp] buffers alive at once: logits, logsumexp's temporary, a filter's masked copy, slack.
_HEAD_COPIES = 4
_FP32, _I64 = 4, 8


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    intermediate: int
    heads: int            # attention heads on this rank
    vocab_local: int      # logits columns on this rank
    dtype_bytes: int
    tp: int = 1
    cp: int = 1

    @classmethod
    def of(cls, config, vocab_local: int, dtype_bytes: int, tp: int = 1, cp: int = 1) -> "ModelDims":
        hidden = int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0))
        inter = int(getattr(config, "intermediate_size", 0) or getattr(config, "n_inner", 0) or 4 * hidden)
        heads = int(getattr(config, "num_attention_heads", 0) or getattr(config, "n_head", 1))
        return cls(hidden, inter // tp, max(1, heads // tp), vocab_local, dtype_bytes, tp, cp)


def weight_bytes(model) -> int:
    """Bytes a loaded model's parameters and buffers hold on its device, each tensor once (tied ones too) and in
    its own dtype: an FP8 weight one byte an element, its scales fp32, the rest the serving dtype."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta" and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def estimate_peak_bytes(job: Job, dims: ModelDims, chunk: int, pending_pieces: int, window_bytes: int,
                        pack_tokens: int = 0, shared_prefixes: bool = False) -> int:
    """Upper estimate of the extra bytes the job holds at its peak on one rank (pack_tokens: 0 in exact mode;
    shared_prefixes: a pack may hold a group's prefix, under its longest sequence, beyond pack_tokens)."""
    longest = max(len(s) for s in job.sequences)
    local = math.ceil(longest / (2 * dims.cp)) * 2 if dims.cp > 1 else longest   # rows on this rank
    body_rows = max(local, pack_tokens)          # a packed body holds the batch's tokens, not the job's
    if pack_tokens and shared_prefixes:          # logitserve.prefix: prefix + continuations <= this
        body_rows += longest
    body = body_rows * (_BODY_HIDDEN_COPIES * dims.hidden + _BODY_MLP_COPIES * dims.intermediate) * max(dims.dtype_bytes, _FP32)
    if dims.cp > 1:   # CP attention masks by position: scores [heads, local, longest] fp32
        body += dims.heads * local * math.ceil(longest / (2 * dims.cp)) * 2 * dims.cp * _FP32
    rows = min(chunk, local)
    head = rows * dims.vocab_local * _FP32 * _HEAD_COPIES if job.needs_logits else 0
    out_row = 0
    if job.topk is not None:
        head += rows * job.topk.k * (_FP32 + _I64) * 2 * dims.tp      # local and merged top-k
        out_row += job.topk.k * (_FP32 + 4)
    if job.logprobs is not None and job.logprobs.top_p is not None:
        head += rows * dims.vocab_local * (_FP32 + _I64)                # growing top-K for top-p
    if job.candidates is not None:
        out_row += max(c.shape[1] for c in job.candidates) * (_FP32 + _I64)
    if job.full_logits is not None:
        out_row += dims.vocab_local * dims.tp * _FP32
    if job.hidden_states is not None:
        out_row += dims.hidden * _FP32
    piece = rows * out_row                     # one chunk's outputs; encoded messages of a stream hold at most 8
    outputs = piece * (pending_pieces + 1) + min(window_bytes, 8 * piece)
    return int(body + head + outputs)
