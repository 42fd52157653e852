"""The TP pass's communication: forwards of modules whose weights hold local shards (gpt-fast style).

Column layers need nothing (their output stays a local shard for the next layer); row
layers all-reduce their partial sums and add the bias once; `gather` layers all-gather
their output columns; `reduce` modules (MoE experts, each rank holding a slice of every
expert) sum their outputs. Every collective runs on the TP group, which has the timeout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import collectives
from .tp_plan import Style


def _row_forward(module: nn.Linear, group, rank: int, split_input: bool):
    weight, bias = module.weight, module.bias     # [out, in/tp], [out] whole
    # an FP8 layer (fp8_linear.Fp8Linear) runs its own GEMM on its FP8 shard; the bias is added once, after the sum
    gemm = getattr(module, "gemm", None) or (lambda x: F.linear(x, weight))

    def forward(x: torch.Tensor) -> torch.Tensor:
        if split_input:                            # x [.., in] replicated: take this rank's columns
            width = weight.shape[-1]
            x = x.narrow(-1, rank * width, width)
        y = gemm(x)                                # [.., out] partial sums
        collectives.all_reduce(y, group=group)
        return y if bias is None else y + bias
    return forward


def _gather_hook(group, tp: int):
    def hook(module, args, out: torch.Tensor) -> torch.Tensor:   # out [.., out/tp]
        parts = [torch.empty_like(out) for _ in range(tp)]
        collectives.all_gather(parts, out.contiguous(), group=group)
        return torch.cat(parts, dim=-1)                           # [.., out]
    return hook


def _reduce_hook(group):
    def hook(module, args, out):
        first = out[0] if isinstance(out, tuple) else out
        collectives.all_reduce(first, group=group)
        return out
    return hook


def shardable_embedding(module: nn.Module) -> bool:
    """nn.Embedding as is, or Gemma 3's scaled one (embedding times embed_scale): forwards we can rewrite."""
    plain = type(module).forward is nn.Embedding.forward
    return isinstance(module, nn.Embedding) and (plain or type(module).__name__.endswith("ScaledWordEmbedding"))


def install_vocab_embedding(module: nn.Embedding, start: int, real: int, group) -> None:
    """Vocab-parallel lookup: this rank holds rows [start, start + real); the others' ids give zeros; all-reduce."""
    weight = module.weight                                   # [ceil(V/tp), H], zero past `real`
    scale = getattr(module, "embed_scale", None)

    def forward(ids: torch.Tensor) -> torch.Tensor:
        local = ids - start
        outside = (local < 0) | (local >= real)              # [B, S]
        out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0)   # [B, S, H]
        collectives.all_reduce(out, group=group)                    # one rank contributes each row: exact
        return out if scale is None else out * scale.to(out.dtype)
    module.forward = forward


def install(module: nn.Module, style: Style, group, rank: int, tp: int) -> None:
    """Give `module` (its parameters already local shards) the communication `style` names."""
    if style.comm in ("reduce", "split") and isinstance(module, nn.Linear):
        module.forward = _row_forward(module, group, rank, split_input=style.comm == "split")
    elif style.comm == "reduce":
        module.register_forward_hook(_reduce_hook(group))
    elif style.comm == "gather":
        module.register_forward_hook(_gather_hook(group, tp))
    elif style.comm:
        raise ValueError(f"{type(module).__name__}: no forward for comm {style.comm!r}")
    if isinstance(module, nn.Linear):              # keep the module's own description truthful
        module.out_features, module.in_features = module.weight.shape
