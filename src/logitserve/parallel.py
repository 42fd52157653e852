"""Tensor/context-parallel set-up: process groups with timeouts, and TP as a pass over a loaded model.

Rank layout: rank = (pp_rank * cp + cp_rank) * tp + tp_rank (TP ranks adjacent, so a
TP group stays inside a node; pipeline stages outermost, so they span nodes). Each rank loads only its part
(logitserve.loading, with the plan from tp_plan; tp = 1 is the same load with trivial groups); logits stay
vocab-sharded [N, V/tp], padded with columns that the engine masks to -inf when tp does not divide V.
"""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .layout import Layout, RankPlace
from .loaded import LoadedModel


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = 1
    cp: int = 1
    collective_timeout_s: float = 60.0   # every collective fails loudly after this
    device: str = "auto"                 # auto | cpu | cuda
    pp: int = 1                          # pipeline stages (logitserve.pipeline)
    pp_balance: str = "compute"          # stages balanced by compute (the embedding counts 0) or memory (all params)

    def __post_init__(self):
        if self.tp < 1 or self.cp < 1 or self.pp < 1:
            raise ValueError(f"tp={self.tp}, cp={self.cp} and pp={self.pp} must all be >= 1")
        if self.pp_balance not in ("compute", "memory"):
            raise ValueError(f"pp_balance={self.pp_balance!r}: choose compute or memory")
        if self.pp > 1 and self.cp > 1:
            raise ValueError(f"--pp {self.pp} with --cp {self.cp}: not supported. CP spreads every sequence over "
                             f"its ranks and runs bodies per sequence; a pipeline needs whole micro-batches per "
                             f"stage. Serve long contexts with --tp x --cp, deep teachers with --tp x --pp")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp


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
    pp_rank: int = 0                            # this rank's pipeline stage
    nested_p2p_group: Optional[dist.ProcessGroup] = None   # --pp: a batch nested between another's steps sends its
                                                # activations here, apart from the other's still in flight

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    def stage_peer(self, step: int) -> int:
        """The rank with this tp_rank (and cp_rank) `step` stages later (negative: earlier)."""
        return self.rank + step * self.tp * self.cp

    @property
    def cp(self) -> int:
        return self.config.cp

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def reports(self) -> bool:
        """Whether this rank emits the events every rank computes alike (a job's failure, shared tokens): the last
        stage's first rank, so that they reach rank 0 once, gathered or (pp = 1) its own."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp - 1


def single_rank(device: str = "cpu") -> ParallelContext:
    return ParallelContext(ParallelConfig(), 0, 0, 0, torch.device(device), None, None, None)


def _device(config: ParallelConfig) -> torch.device:
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def nccl_options(device: torch.device) -> dict:
    """NCCL that raises: a timed-out collective must raise in the rank (so rank 0 answers UNAVAILABLE and exits
    non-zero) rather than be aborted by the watchdog; and NCCL bound to this rank's GPU from the start
    (device_id, where this torch takes it). Set before the process group exists; the user's settings win."""
    os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")           # waits raise on timeout
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")    # the watchdog does not tear the process down
    from .capabilities import probe

    return {"device_id": device} if probe(str(device)).nccl_device_id else {}


def init_parallel(config: ParallelConfig) -> ParallelContext:
    """Join the process group (env:// rendezvous: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and make the groups."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != config.world_size:
        raise ValueError(f"WORLD_SIZE={world} but tp x cp x pp = {config.tp} x {config.cp} x {config.pp} = "
                         f"{config.world_size}")
    device = _device(config)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=config.collective_timeout_s)
    kw = nccl_options(device) if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kw)
    tp, cp = config.tp, config.cp
    tp_rank, cp_rank, pp_rank = rank % tp, (rank // tp) % cp, rank // (tp * cp)
    tp_group = cp_group = None
    for c in range(cp * config.pp):   # every rank creates every group, in the same order
        g = dist.new_group([c * tp + t for t in range(tp)], timeout=timeout, backend=backend)
        if c == rank // tp and tp > 1:
            tp_group = g
    for t in range(tp):
        g = dist.new_group([c * tp + t for c in range(cp)], timeout=timeout, backend=backend)
        if t == tp_rank and cp > 1:
            cp_group = g
    control = dist.new_group(list(range(world)), timeout=timeout, backend="gloo")
    nested = dist.new_group(list(range(world)), timeout=timeout, backend=backend) if config.pp > 1 else None
    return ParallelContext(config, rank, tp_rank, cp_rank, device, tp_group, cp_group, control, pp_rank, nested)


def gather_layout(ctx: ParallelContext) -> Layout:
    """Every rank's place and device, known to all (for model_info)."""
    me = RankPlace(ctx.rank, ctx.tp_rank, ctx.cp_rank, socket.gethostname(), str(ctx.device), ctx.pp_rank)
    if ctx.control_group is None:
        return Layout(1, 1, (me,))
    places = [None] * ctx.config.world_size
    dist.all_gather_object(places, me, group=ctx.control_group)
    return Layout(ctx.tp, ctx.cp, tuple(places), ctx.pp)


STARTUP_TIMEOUT_S = 3600.0     # ranks waiting for rank 0's checkpoint hash at start-up


def startup_barrier(ctx: ParallelContext, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Every rank here before any model collective: a gloo barrier on the control group with its own timeout."""
    if ctx.control_group is None:
        return
    dist.monitored_barrier(ctx.control_group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)


def hook_cp(loaded: LoadedModel, ctx: ParallelContext) -> None:
    """Under CP, attention all-gathers K/V over the CP group (context_parallel)."""
    from .context_parallel import CP_ATTENTION, register_cp_attention

    if ctx.cp > 1:
        register_cp_attention()
        loaded.model.set_attn_implementation(CP_ATTENTION)
