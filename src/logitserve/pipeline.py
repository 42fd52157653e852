"""Pipeline parallelism for a forward-only server: contiguous decoder-layer stages and the micro-batch schedule.

Stages split the decoder layers by parameter count (the embedding counted on the first
stage, the final norm and the lm_head on the last). Every rank plans the same packs
(micro-batches) for a batch. Stage s works `lead = pp - 1 - s` micro-batches ahead of the
last stage: it receives micro-batch i's activations `[tokens, H]` from stage s - 1, runs
its layers and sends them on (isend: it goes on with the next while they travel), so
after the fill every stage works at once. The last stage runs the head on micro-batch i
and its events go to rank 0 in the runner's step gather: a first step long enough for the
earlier stages' bodies to overlap it, then one per head step left, on every rank alike
(planned from the jobs and the stages' sizes), which is also what
keeps the stages in step: stage s enters micro-batch i's gather only after sending
micro-batch i + lead. In flight per stage: `lead` micro-batches (the fewest that keep the
last stage fed without a stall, and a bounded activation memory of lead x [tokens, H]).
A batch of small jobs may run between two steps (server.batch_runner): its activations go
on a group of their own (ParallelContext.nested_p2p_group), so they never meet the outer
batch's still in flight. Every send and receive runs under the process group's timeout.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .events import StageTime, Step
from .packing import Pack
from .schedule import pack_rows


def split_stages(layer_sizes: list[int], first_extra: int, last_extra: int, pp: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges [a, b), one per stage, each non-empty, minimising the largest stage's parameters
    (first_extra: the embedding's, on stage 0; last_extra: the norm's and head's, on the last stage)."""
    n = len(layer_sizes)
    if not 1 <= pp <= n:
        raise ValueError(f"--pp {pp}: the model has {n} decoder layers; at most {n} stages, at least 1")
    prefix = [0]
    for x in layer_sizes:
        prefix.append(prefix[-1] + x)
    INF = float("inf")
    # best[s][i]: the smallest possible largest stage when stages 0..s-1 hold layers [0, i)
    best = [[INF] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for i in range(s, n - (pp - s) + 1):
            for j in range(s - 1, i):
                size = prefix[i] - prefix[j] + (first_extra if s == 1 else 0) + (last_extra if s == pp else 0)
                value = max(best[s - 1][j], size)
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds, i = [], n
    for s in range(pp, 0, -1):
        j = cut[s][i]
        bounds.append((j, i))
        i = j
    return bounds[::-1]


def bubble_fraction(times: list[StageTime]) -> float:
    """The share of the stages' time spent waiting: 1 - sum(busy) / sum(wall)."""
    wall = sum(t.wall_s for t in times)
    return 0.0 if wall <= 0 else max(0.0, 1.0 - sum(t.busy_s for t in times) / wall)


class ZeroEmbedding(nn.Module):
    """A later stage's input embedding: no weights, zeros of the right shape (the first local layer's input is
    replaced by the received activations; models that scale their embeddings scale zeros)."""

    def __init__(self, hidden: int, dtype: torch.dtype, num_embeddings: int):
        super().__init__()
        self.hidden, self.dtype, self.num_embeddings = hidden, dtype, num_embeddings
        self.register_buffer("anchor", torch.zeros(0, dtype=dtype), persistent=False)     # follows .to(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*ids.shape, self.hidden, dtype=self.dtype, device=self.anchor.device)


class StageInput:
    """Feeds the received activations to the stage's first layer, in place of what the body computed before it."""

    def __init__(self, first_layer: nn.Module):
        self.value: Optional[torch.Tensor] = None                                    # [N, H]
        first_layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if self.value is None:
            return None
        x = self.value[None]                                                         # [1, N, H]
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}


def install_stage(body: nn.Module, layers: tuple[int, int], stage: int, pp: int, hidden: int,
                  dtype: torch.dtype) -> Optional[StageInput]:
    """Keep this stage's decoder layers [a, b) of `body` (its others were never loaded), a weightless embedding on
    later stages, no final norm before the last. The StageInput of a later stage, or None on the first."""
    if not isinstance(getattr(body, "layers", None), nn.ModuleList) or not hasattr(body, "norm"):
        raise ValueError(f"{type(body).__name__}: pipeline stages need a `layers` ModuleList and a final `norm`")
    a, b = layers
    body.layers = nn.ModuleList(list(body.layers)[a:b])
    if stage < pp - 1:
        body.norm = nn.Identity()
    if stage == 0:
        return None
    body.set_input_embeddings(ZeroEmbedding(hidden, dtype, body.get_input_embeddings().num_embeddings))
    return StageInput(body.layers[0])


def pipeline_steps(engine, run, units: list[Pack], nested: bool = False) -> Iterator[Step]:
    """This rank's Steps for a batch under PP, the same count on every rank: for each micro-batch (unit) a first
    step of Engine.pp_first_steps[rows] head steps (the earlier stages' bodies of the micro-batches ahead overlap them),
    then one step per head step left (Engine.head_step_bound, planned from the jobs alone; padded with empty ones
    when jobs drop), between which a small batch may run. The last stage's head events are
    gathered to rank 0; every stage's StageTime comes with the last. `engine`: the Engine. `nested`: a batch run
    between another's steps sends on its own group, apart from the other's activations still in flight."""
    ctx = engine.parallel
    stage, pp = ctx.pp_rank, ctx.pp
    lead = pp - 1 - stage
    flow = _StageFlow(engine, run, units, stage, ctx.nested_p2p_group if nested else None)
    first = engine.pp_first_steps[run.step_rows]   # head steps in a micro-batch's first step: the bodies overlap them
    last = {m.job: k for k, unit in enumerate(units) for m in unit.members if m.job >= 0}   # job -> its last unit
    for i in range(min(lead, len(units))):
        flow.advance(i)
    for i, unit in enumerate(units):
        if i + lead < len(units):
            flow.advance(i + lead)
        members = list(unit.members)              # the body ran for every member, dropped ones included
        jobs = tuple(dict.fromkeys(m.job for m in members if m.job >= 0))
        planned = 1 + max(0, engine.head_step_bound(run, members) - first)
        ending = tuple(j for j in jobs if last[j] == i)       # complete after this micro-batch's last step
        heads: Iterator[Step] = iter(())
        if stage == pp - 1:
            heads = engine.head_steps(run, members, flow.done.pop(i), pack_rows(members))
        for k in range(planned):
            t0 = time.perf_counter()
            got = list(heads) if k == planned - 1 else list(itertools.islice(heads, first if k == 0 else 1))
            flow.busy += time.perf_counter() - t0
            events = [e for s in got for e in s.events]
            if i == len(units) - 1 and k == planned - 1:
                events.append(StageTime(stage, flow.busy, time.perf_counter() - flow.t_start))
            yield Step(jobs, tuple(events), ending if k == planned - 1 else ())
    flow.finish()


class _StageFlow:
    """This stage's side of the micro-batches: receive, run its layers, send on (or keep, on the last stage)."""

    def __init__(self, engine, run, units: list[Pack], stage: int, group: Optional[dist.ProcessGroup]):
        self.engine, self.run, self.units, self.stage, self.group = engine, run, units, stage, group
        self.last = stage == engine.parallel.pp - 1
        self.lead = engine.parallel.pp - 1 - stage
        self.in_flight: list = []                 # (work, tensor) of sends not yet known to have left
        self.done: dict[int, torch.Tensor] = {}   # the last stage's hidden states by micro-batch
        self.busy = 0.0
        self.t_start = time.perf_counter()

    def advance(self, i: int) -> None:
        engine, ctx = self.engine, self.engine.parallel
        members = list(self.units[i].members)
        if self.stage > 0:
            n = sum(m.length for m in members)
            incoming = torch.empty(n, engine.hidden_size, dtype=engine.act_dtype, device=engine.device)   # [N, H]
            dist.recv(incoming, src=ctx.stage_peer(-1), group=self.group)
            engine.stage_input.value = incoming
        t0 = time.perf_counter()
        h = engine.unit_body(self.run.jobs, members)                                               # [N, H]
        self.busy += time.perf_counter() - t0
        if engine.stage_input is not None:
            engine.stage_input.value = None
        if self.last:
            self.done[i] = h
            return
        h = h.contiguous()
        self.in_flight.append((dist.isend(h, dst=ctx.stage_peer(1), group=self.group), h))
        while len(self.in_flight) > max(self.lead, 1):
            self.in_flight.pop(0)[0].wait()

    def finish(self) -> None:
        for work, _ in self.in_flight:
            work.wait()
