"""Tensor/context-parallel set-up: process groups with timeouts, and TP as a pass over a loaded model.

Rank layout: rank = cp_rank * tp + tp_rank (TP ranks adjacent, so a TP group
stays inside a node). The TP plan is data, per model_type; the lm_head is
sliced column-parallel by hand so logits stay vocab-sharded [N, V/tp], padded
with columns that the engine masks to -inf when tp does not divide V.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .layout import Layout, RankPlace
from .loading import LoadedModel
from .vocab_parallel import VocabShard, full_vocab


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    collective_timeout_s: float = 60.0   # every collective fails loudly after this
    device: str = "auto"                 # auto | cpu | cuda

    def __post_init__(self):
        if self.tp < 1 or self.cp < 1:
            raise ValueError(f"tp={self.tp} and cp={self.cp} must both be >= 1")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp


@dataclass(frozen=True)
class ParallelContext:
    config: ParallelConfig
    rank: int
    tp_rank: int
    cp_rank: int
    device: torch.device
    tp_group: Optional[dist.ProcessGroup]       # None when tp = 1
    cp_group: Optional[dist.ProcessGroup]       # None when cp = 1
    control_group: Optional[dist.ProcessGroup]  # gloo, for jobs and results; None when world = 1

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def is_root(self) -> bool:
        return self.rank == 0


def single_rank(device: str = "cpu") -> ParallelContext:
    return ParallelContext(ParallelConfig(), 0, 0, 0, torch.device(device), None, None, None)


def _device(config: ParallelConfig) -> torch.device:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def init_parallel(config: ParallelConfig) -> ParallelContext:
    """Join the process group (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and make the groups."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        raise ValueError(f"WORLD_SIZE={world} but tp x cp = {config.tp} x {config.cp} = {config.world_size}")
    device = _device(config)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    tp, cp = config.tp, config.cp
    tp_rank, cp_rank = rank % tp, rank // tp
    tp_group = cp_group = None
    for c in range(cp):   # every rank creates every group, in the same order
        g = dist.new_group([c * tp + t for t in range(tp)], timeout=timeout, backend=backend)
        if c == cp_rank and tp > 1:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([c * tp + t for c in range(cp)], timeout=timeout, backend=backend)
        if t == tp_rank and cp > 1:
            cp_group = g
    control = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    return ParallelContext(config, rank, tp_rank, cp_rank, device, tp_group, cp_group, control)


def gather_layout(ctx: ParallelContext) -> Layout:
    """Every rank's place and device, known to all (for model_info)."""
    me = RankPlace(ctx.rank, ctx.tp_rank, ctx.cp_rank, socket.gethostname(), str(ctx.device))
    if ctx.control_group is None:
        return Layout(1, 1, (me,))
    places = [None] * ctx.config.world_size
    dist.all_gather_object(places, me, group=ctx.control_group)
    return Layout(ctx.tp, ctx.cp, tuple(places))


# --- TP plans: module path patterns -> style, per transformers model_type ----------------
def _llama_like_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "layers.*.self_attn.q_proj": ColwiseParallel(),
        "layers.*.self_attn.k_proj": ColwiseParallel(),
        "layers.*.self_attn.v_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(),
        "layers.*.mlp.gate_proj": ColwiseParallel(),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(),
    }


TP_PLANS = {"llama": _llama_like_plan, "qwen2": _llama_like_plan, "qwen3": _llama_like_plan,
            "mistral": _llama_like_plan, "granite": _llama_like_plan}


def _check_divisible(config, tp: int) -> None:
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name, None)
        if value is not None and value % tp:
            raise ValueError(f"config.{name}={value} does not divide by tp={tp}")


def shard_head(head: nn.Linear, ctx: ParallelContext, vocab_size: int) -> tuple[nn.Linear, VocabShard]:
    """Column-parallel lm_head: rows [r*ceil(V/tp), (r+1)*ceil(V/tp)) of W, zero-padded past V."""
    local = math.ceil(vocab_size / ctx.tp)
    start = ctx.tp_rank * local
    weight = torch.zeros(local, head.in_features, dtype=head.weight.dtype, device=head.weight.device)
    real = max(0, min(vocab_size, start + local) - start)
    weight[:real] = head.weight[start : start + real]
    sharded = nn.Linear(head.in_features, local, bias=head.bias is not None, device=weight.device, dtype=weight.dtype)
    sharded.weight = nn.Parameter(weight, requires_grad=False)
    if head.bias is not None:
        bias = torch.zeros(local, dtype=head.bias.dtype, device=head.bias.device)
        bias[:real] = head.bias[start : start + real]
        sharded.bias = nn.Parameter(bias, requires_grad=False)
    return sharded, VocabShard(start=start, size=local, vocab_size=vocab_size, group=ctx.tp_group)


def apply_parallelism(loaded: LoadedModel, ctx: ParallelContext) -> tuple[LoadedModel, VocabShard]:
    """The pass over a loaded model: move to the device, shard the body (TP) and the head, hook CP attention."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import parallelize_module

    from .context_parallel import CP_ATTENTION, register_cp_attention
    from .spec import ModelKind

    loaded.model.to(ctx.device)
    shard = full_vocab(loaded.vocab_size)
    head = loaded.head
    if ctx.tp > 1:
        model_type = loaded.model.config.model_type
        if model_type not in TP_PLANS:
            raise ValueError(f"no TP plan for model_type {model_type!r}; known: {sorted(TP_PLANS)}")
        _check_divisible(loaded.model.config, ctx.tp)
        mesh = DeviceMesh.from_group(ctx.tp_group, ctx.device.type)
        parallelize_module(loaded.body, mesh, TP_PLANS[model_type]())
        if loaded.kind is ModelKind.CAUSAL_LM:
            head, shard = shard_head(loaded.head, ctx, loaded.vocab_size)
    if ctx.cp > 1:
        register_cp_attention()
        loaded.model.set_attn_implementation(CP_ATTENTION)
    return dataclasses.replace(loaded, head=head), shard
