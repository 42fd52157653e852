"""Runs a batch of Jobs: the model body (packed across sequences, or once per sequence), then the head chunk by chunk.

Batching modes (one per server):
- PACKED: a batch's sequences run through the body as one packed row (varlen
  attention, positions restarting per sequence) and the head runs on chunks of
  that row, so throughput follows tokens, not sequence count. Results equal the
  per-sequence ones up to fp32 rounding of differently shaped GEMMs (documented
  bound 1e-5; README: Batching).
- EXACT: every sequence runs alone at its exact length and its head chunks start
  at its own row 0: results are bitwise independent of the batch.
Under CP the body always runs per sequence (each sequence is spread over the CP ranks).
Extra memory for the head is O(chunk x V/tp): the [L, V] logits never exist at once.
Results leave step by step as `Piece`s, rectangles of an output with their offsets.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from .batch_run import BatchRun as _Run
from .context_parallel import cp_forward, head_tail
from .loading import LoadedModel
from .memory import ModelDims
from .outputs import HeadShard, Piece, Segment, block_pieces, empty_token_pieces, hidden_pieces
from .packing import (VARLEN_ATTENTION, Pack, cpu_pack_tokens, packed_forward, packed_positions, plan_packs,
                      register_varlen_attention)
from .parallel import ParallelContext, single_rank
from .prefix import Wanted, find_groups, live_members, plan_shared_packs, shared_by_job
from .spec import Job, OutputKind
from .vocab_parallel import VocabShard, full_vocab

__all__ = ["Batching", "Engine", "EngineConfig", "Piece", "Step"]


class Batching(enum.Enum):
    """How a batch's sequences go through the model body; names equal the proto's Batching values."""

    EXACT = "exact"
    PACKED = "packed"


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 512                   # rows of logits materialized at a time (--logprob-chunk-size)
    batching: Batching = Batching.PACKED    # --batching
    max_pack_tokens: int = 16384            # tokens per packed body at most (a longer sequence packs alone);
                                            # on CPU also at most packing.cpu_pack_tokens (allocator-friendly)
    min_shared_prefix: int = 64             # packed: sequences sharing this many leading tokens share their
                                            # prefix's body (logitserve.prefix); 0 = off (--min-shared-prefix)
    pp_microbatch_tokens: int = 512         # --pp: tokens per micro-batch (pack) at most (--pp-microbatch-tokens)

    def __post_init__(self):
        if self.chunk_size < 1 or self.max_pack_tokens < 1 or self.min_shared_prefix < 0:
            raise ValueError(f"chunk_size={self.chunk_size} and max_pack_tokens={self.max_pack_tokens} must be >= 1, "
                             f"min_shared_prefix={self.min_shared_prefix} >= 0")


@dataclass(frozen=True)
class Step:
    """One step of a batch. `jobs` is the same on every rank; pieces and errors are this rank's."""

    jobs: tuple[int, ...]                                  # the jobs this step computed for
    pieces: tuple[tuple[int, Piece], ...] = ()             # (job, piece) this rank emits
    errors: tuple[tuple[int, Exception], ...] = ()         # jobs that failed here (alike on every rank)
    shared: tuple[tuple[int, int], ...] = ()               # (job, tokens its sequences did not compute: a
                                                           # shared prefix, counted once per group), rank 0's


@dataclass(frozen=True)
class SharedTokens:
    """Goes down a job's stream beside its pieces: tokens of its sequences computed once for a group."""

    tokens: int


class Engine:
    """Owns a (possibly sharded) model and turns a batch of Jobs into Steps on this rank.

    Every rank takes the same steps for the same batch, so a distributed runner can
    gather step by step. Under TP only tp_rank 0 emits the outputs every TP rank holds
    alike; each TP rank emits its own vocab columns of full-logits slices.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                 shard: VocabShard | None = None, parallel: ParallelContext | None = None):
        self.loaded = loaded
        self.config = config
        self.shard = shard or full_vocab(loaded.vocab_size)
        self.parallel = parallel or single_rank(str(loaded.head.weight.device))
        self.device = loaded.head.weight.device
        from .head_export import accumulates_fp32

        self._mm_fp32 = loaded.head.weight.dtype != torch.float32 and accumulates_fp32(loaded.head.weight)
        from .packing import probe_flash

        probe_flash(self.device, loaded.head.weight.dtype)     # on a GPU in bf16/fp16: flash or sdpa, decided now
        self._zbuf: torch.Tensor | None = None   # [chunk, V/tp] fp32, reused: fresh 64 MiB buffers cost page faults
        # Local columns from here on are padding (tp does not divide V): masked to -inf.
        pad_from = min(self.shard.size, max(0, self.shard.vocab_size - self.shard.start))
        self.head_shard = HeadShard(self.shard, pad_from, emits_replicated=self.parallel.tp_rank == 0)
        self.hidden_size = int(loaded.head.in_features)      # H: the width of HIDDEN_STATES
        # Packing needs each sequence whole on one rank: under CP the body runs per sequence. Under PP the
        # micro-batches are packs (logitserve.pipeline).
        self.batching = Batching.EXACT if self.parallel.cp > 1 else config.batching
        if self.parallel.pp > 1:
            self.batching = Batching.PACKED
        self.act_dtype = loaded.dtype            # activations between pipeline stages
        self.stage_input = loaded.stage_input
        self.pack_tokens = 0                     # tokens per packed body; 0 in exact mode
        if self.batching is Batching.PACKED:
            sinks = [n for n, _ in loaded.body.named_parameters() if n.endswith(".sinks")]
            if sinks:    # gpt-oss: packed attention would have to add each head's sink logit; refuse, do not drop
                raise ValueError(f"{loaded.architecture} has attention sinks ({sinks[0]}, ...), which packed "
                                 f"attention does not implement: serve it with --batching exact")
            register_varlen_attention()
            loaded.model.set_attn_implementation(VARLEN_ATTENTION)
            self.pack_tokens = config.max_pack_tokens
            if self.device.type == "cpu":
                dims = ModelDims.of(loaded.model.config, self.shard.size, loaded.head.weight.element_size(),
                                    self.parallel.tp)
                self.pack_tokens = cpu_pack_tokens(dims.hidden, dims.intermediate, config.max_pack_tokens)
            if self.parallel.pp > 1:        # micro-batches: several per batch keep every stage busy
                self.pack_tokens = min(self.pack_tokens, config.pp_microbatch_tokens)

    # -- the model ------------------------------------------------------------
    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last hidden state of the body at these global positions. ids, positions: [n] -> [n, H]."""
        with cp_forward(self.parallel.cp_group, positions):
            out = self.loaded.body(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def packed_hidden(self, ids: torch.Tensor, lengths: list[int], starts: Optional[list[int]] = None,
                      parents: Optional[list[int]] = None) -> torch.Tensor:
        """Last hidden state of several segments packed in one row; a segment with a parent continues that
        shared prefix from position starts[i]. ids: [N] -> [N, H]."""
        positions = packed_positions(lengths, starts).to(self.device)                           # [N]
        with packed_forward(lengths, self.device, parents):
            out = self.loaded.body(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """z/T in fp32 for a chunk of rows, in the engine's reused buffer (valid until the next call). h: [c, H] -> [c, V/tp]."""
        head = self.loaded.head
        rows, cols = h.shape[0], head.out_features
        if self._zbuf is None or self._zbuf.shape[0] < rows:
            self._zbuf = torch.empty(max(rows, self.config.chunk_size), cols, dtype=torch.float32, device=h.device)
        z = self._zbuf[:rows]
        if head.weight.dtype == torch.float32:
            torch.matmul(h, head.weight.t(), out=z)
            if head.bias is not None:
                z.add_(head.bias)
        elif self._mm_fp32:   # CUDA: bf16/fp16 inputs, fp32 output: the logits are never rounded to bf16
            z.copy_(torch.mm(h, head.weight.t(), out_dtype=torch.float32))
            if head.bias is not None:
                z.add_(head.bias)
        else:   # reduced-precision models: the matmul in their dtype, upcast into the buffer
            z.copy_(F.linear(h, head.weight, head.bias))
        if not self.loaded.transform.identity:   # softcapping / logit scale, in fp32, before temperature
            self.loaded.transform.apply_(z)
        if temperature != 1.0:
            z.div_(temperature)
        if self.head_shard.pad_from < z.shape[-1]:
            z[:, self.head_shard.pad_from :] = float("-inf")
        return z

    # -- a batch --------------------------------------------------------------
    def run(self, job: Job) -> Iterator[Piece]:
        """Every Piece this rank emits for one job run alone, in order; failures raise."""
        for step in self.batch_steps([job], isolate=False):
            yield from (piece for _, piece in step.pieces)

    def batch_steps(self, jobs: list[Job], skip: Optional[Callable[[int], bool]] = None,
                    isolate: bool = True) -> Iterator[Step]:
        """This rank's Steps for a whole batch.

        `skip(j)` drops job j (cancelled) from the work not yet done. With `isolate`, a job
        whose work fails gets its exception in one Step and is dropped; the others go on.
        Shared work that fails (a packed body, a head chunk of several jobs) is redone per
        job, so a failure lands on the job that caused it. Across ranks this keeps them in
        step as long as every rank raises alike for the same job (a request's own error);
        a failed collective (CollectiveFailed) is never isolated: the ranks are out of step.
        """
        run = _Run(jobs, skip or (lambda j: False), isolate, across_ranks=self.parallel.config.world_size > 1)
        if self.parallel.pp > 1:
            from .pipeline import pipeline_steps

            yield from pipeline_steps(self, run, self._plan(run))
            return
        if self.batching is Batching.EXACT:
            for j, job in enumerate(jobs):
                for i, seq in enumerate(job.sequences):
                    if run.live(j):
                        yield from run.guard(j, self._sequence_steps(j, job, i, self._ids(seq)))
            return
        for pack in self._plan(run):
            yield from self._pack_steps(run, pack)

    def _plan(self, run: "_Run") -> list[Pack]:
        """Packs of the batch's live sequences; with min_shared_prefix, groups sharing a prefix (logitserve.prefix)."""
        jobs = run.jobs
        live = [(j, i, s) for j, job in enumerate(jobs) if run.live(j) for i, s in enumerate(job.sequences)]
        if self.config.min_shared_prefix:
            V = self.shard.vocab_size
            wanted = [Wanted(j, i, s, jobs[j].first_read(i, V)) for j, i, s in live]
            groups, alone = find_groups(wanted, self.config.min_shared_prefix)
            if groups:
                return plan_shared_packs(groups, alone, self.pack_tokens)
        return plan_packs([(j, i, len(s)) for j, i, s in live], self.pack_tokens)

    def _ids(self, seq) -> torch.Tensor:
        return torch.from_numpy(seq.astype("int64", copy=False)).to(self.device)                 # [L]

    def _body_tokens(self, jobs: list[Job], body: list) -> tuple[dict, list[torch.Tensor]]:
        """(each member's ids by (job, sequence), each body member's token run) of a pack's members; a shared
        prefix's tokens are the start of the sequence that continues it."""
        ids = {(m.job, m.sequence): self._ids(jobs[m.job].sequences[m.sequence]) for m in body if m.job >= 0}
        tokens = []
        for k, m in enumerate(body):
            src = m if m.job >= 0 else next(x for x in body[k + 1:] if x.parent == k)
            tokens.append(ids[(src.job, src.sequence)][m.start : m.start + m.length])
        return ids, tokens

    def _cands(self, job: Job, sequences) -> dict[int, torch.Tensor]:
        """Candidate ids of these sequences of the job: sequence -> [L, c] (empty when the job asks for none)."""
        if job.candidates is None:
            return {}
        return {i: self._ids(job.candidates[i]) for i in sequences}

    # -- exact: one sequence at a time ------------------------------------------------
    def _sequence_steps(self, j: int, job: Job, i: int, ids: torch.Tensor) -> Iterator[Step]:
        """Sequence i alone: per run of rows this rank holds (CP), per chunk of rows."""
        p = self.parallel
        L = len(ids)
        positions, runs = head_tail(L, p.cp, p.cp_rank)                                         # [n_local]
        positions = positions.to(self.device)
        local_ids = F.pad(ids, (0, max(0, int(positions.max()) + 1 - L)))[positions]           # [n_local]
        h = self.hidden(local_ids, positions)                                                   # [n_local, H]
        if job.scores:   # from the rank holding the last position (its TP rank 0): one step either way
            last = positions == L - 1
            holds_last = self.head_shard.emits_replicated and bool(last.any())
            yield Step((j,), tuple((j, piece) for piece in self._scores(h[last], [i])) if holds_last else ())
            return
        cands = self._cands(job, [i])
        chunk = self.config.chunk_size
        lo, hi = job.head_rows(i, self.shard.vocab_size)          # only rows someone reads go through the head
        span = job.token_rows(i) if job.prompt_lengths is not None else None
        if _span_is_empty(job, i):     # a Step on every rank (they gather step by step), pieces from one
            empty = empty_token_pieces(job, i, self.head_shard, cands, self.hidden_size) if p.cp_rank == 0 else []
            yield Step((j,), tuple((j, piece) for piece in empty))
        for run in runs:
            for c0 in range(0, run.length, chunk):
                s0 = run.start + c0                               # global rows [s0, s1) of this step
                s1 = min(run.start + min(c0 + chunk, run.length), L)
                a, b = max(s0, lo), min(s1, hi)
                if a >= b:                  # padding, or rows nobody reads: an empty step (ranks stay in step)
                    yield Step((j,))
                    continue
                if self.batching is Batching.EXACT:   # whole chunks: rows bitwise those of a request without a span
                    a, b = s0, s1
                rows = h[run.local + c0 + (a - s0) : run.local + c0 + (b - s0)]                  # [c, H]
                segs = [Segment(i, ids, a, b, 0, span)]
                pieces = hidden_pieces(job, rows, segs, self.head_shard)
                if job.needs_logits:
                    z = self.logits(rows, job.temperature)                                      # [c, V/tp]
                    pieces += block_pieces(job, z, segs, self.head_shard, cands)
                yield Step((j,), tuple((j, piece) for piece in pieces))

    @torch.inference_mode()
    def _scores(self, last: torch.Tensor, sequences: list[int]) -> list[Piece]:
        """The reward head on each sequence's last hidden state. last: [n, H] -> n Pieces of [num_labels]."""
        scores = F.linear(last, self.loaded.head.weight, self.loaded.head.bias).float().cpu()   # [n, num_labels]
        return [Piece(OutputKind.SCORES, i, (scores.shape[1],), (0,), scores[r].contiguous())
                for r, i in enumerate(sequences)]

    # -- packed: one body for many sequences --------------------------------------------
    def _pack_steps(self, run: "_Run", pack: Pack, h: Optional[torch.Tensor] = None) -> Iterator[Step]:
        """A pack's steps; `h` [N, H]: its body already ran (the last pipeline stage), for every member."""
        jobs = run.jobs
        # with shared prefixes (job -1) that some live member continues; under PP the body ran for all of them
        body = live_members(pack, run.live) if h is None else list(pack.members)
        members = [m for m in body if m.job >= 0]
        if not members:
            return
        ids, tokens = self._body_tokens(jobs, body)
        try:
            if h is None:
                h = self.packed_hidden(torch.cat(tokens), [m.length for m in body], [m.start for m in body],
                                       [m.parent for m in body])                                 # [N, H]
        except Exception as e:
            run.reraise_unless_isolated(e)
            for m in members:   # redo per sequence: whoever fails, fails alone
                if run.live(m.job):
                    yield from run.guard(m.job, self._sequence_steps(m.job, jobs[m.job], m.sequence, ids[(m.job, m.sequence)]))
            return
        offsets, at, places = [], 0, {}
        for m in body:          # row offsets inside h (the pack's own offsets count dropped members)
            places[id(m)] = at
            at += m.length
        offsets = [places[id(m)] for m in members]
        shared = shared_by_job(body)
        if shared:
            yield Step(tuple(j for j, _ in shared), shared=shared if self.head_shard.emits_replicated else ())
        if jobs[members[0].job].scores:   # reward models: every job of the batch wants scores
            last = h[torch.tensor([o + m.length - 1 for o, m in zip(offsets, members)], device=h.device)]   # [n, H]
            by_job: dict[int, list[int]] = {}
            for r, m in enumerate(members):
                by_job.setdefault(m.job, []).append(r)
            pieces = [(j, p) for j, rows in by_job.items()
                      for p in self._scores(last[rows], [members[r].sequence for r in rows])]
            yield Step(tuple(by_job), tuple(pieces) if self.head_shard.emits_replicated else ())
            return
        cands = {j: self._cands(jobs[j], [m.sequence for m in members if m.job == j])
                 for j in dict.fromkeys(m.job for m in members)}
        spanless = [m for m in members if _span_is_empty(jobs[m.job], m.sequence)]
        if spanless:                   # a Step on every rank (they gather step by step), pieces from TP rank 0
            yield Step(tuple(dict.fromkeys(m.job for m in spanless)),
                       tuple((m.job, piece) for m in spanless
                             for piece in empty_token_pieces(jobs[m.job], m.sequence, self.head_shard, cands[m.job],
                                                             self.hidden_size)))
        # The head runs only on the rows someone reads (all of them unless prompt_lengths or a slice say less):
        # each member's rows [lo, hi), gathered into one [M, H] block when that is not all of h.
        V = self.shard.vocab_size
        spans = [jobs[m.job].head_rows(m.sequence, V) for m in members]   # global rows; a continuation's start
        picked, at_sel = [], 0                            # (row of global position 0, lo, hi, offset in the selection)
        for o, m, (lo, hi) in zip(offsets, members, spans):
            picked.append((o - m.start, lo, hi, at_sel))  # (lo >= start: no read row lies inside a shared prefix)
            at_sel += hi - lo
        if at_sel != at:
            index = torch.cat([torch.arange(o + lo, o + hi) for o, lo, hi, _ in picked]).to(h.device)   # [M]
            h = h.index_select(0, index)                                                   # [M, H]
        chunk = self.config.chunk_size
        for c0 in range(0, at_sel, chunk):
            c1 = min(c0 + chunk, at_sel)
            segs: dict[int, list[Segment]] = {}           # job -> its segments in this chunk, rows relative to c0
            for m, (o, lo, hi, q) in zip(members, picked):
                a, b = max(q, c0), min(q + hi - lo, c1)
                if a < b and run.live(m.job):
                    job = jobs[m.job]
                    span = job.token_rows(m.sequence) if job.prompt_lengths is not None else None
                    segs.setdefault(m.job, []).append(Segment(m.sequence, ids[(m.job, m.sequence)], lo + a - q,
                                                              lo + b - q, a - c0, span))
            if segs:               # every member dropped (cancelled, too slow): no head for these rows
                yield self._chunk_step(run, h[c0:c1], segs, cands)

    @torch.inference_mode()
    def _chunk_step(self, run: "_Run", h: torch.Tensor, segs: dict[int, list[Segment]], cands: dict) -> Step:
        """One head chunk of a pack: one matmul for all its rows, then each job's outputs on its own rows
        (hidden states straight from h; no matmul when no job of the chunk reads logits)."""
        z = None
        if any(run.jobs[j].needs_logits for j in segs):
            try:
                z = self.logits(h)                                                              # [c, V/tp] at T = 1
            except Exception as e:
                run.reraise_unless_isolated(e)      # z None: redone per job below
        pieces, errors = [], []
        for j, job_segs in segs.items():
            job = run.jobs[j]
            first, last = job_segs[0].row, job_segs[-1].rows.stop
            consecutive = all(a.rows.stop == b.row for a, b in zip(job_segs, job_segs[1:]))
            try:
                mine = hidden_pieces(job, h, job_segs, self.head_shard)
                if not job.needs_logits:
                    pieces += [(j, p) for p in mine]
                    continue
                if not consecutive:        # shared prefixes can interleave jobs: this job's rows, gathered
                    index = torch.cat([torch.arange(g.rows.start, g.rows.stop) for g in job_segs]).to(h.device)
                    zj = self.logits(h.index_select(0, index), job.temperature) if z is None else \
                        z.index_select(0, index).div_(job.temperature)
                    rebased, at = [], 0
                    for g in job_segs:
                        rebased.append(Segment(g.sequence, g.ids, g.s0, g.s1, at, g.span))
                        at += g.s1 - g.s0
                elif z is None:
                    zj = self.logits(h[first:last], job.temperature)
                else:
                    zj = z[first:last]
                    if job.temperature != 1.0:
                        zj.div_(job.temperature)
                if consecutive:
                    rebased = [Segment(g.sequence, g.ids, g.s0, g.s1, g.row - first, g.span) for g in job_segs]
                mine += block_pieces(job, zj, rebased, self.head_shard, cands[j])
                pieces += [(j, p) for p in mine]       # all of a job's pieces of the chunk, or its error alone
            except Exception as e:
                run.reraise_unless_isolated(e)
                run.failed.add(j)
                errors.append((j, e))
        return Step(tuple(segs), tuple(pieces), tuple(errors))


def _span_is_empty(job: Job, i: int) -> bool:
    """prompt_lengths P = L: nothing to predict, yet every token output asked for must arrive (empty)."""
    return (job.prompt_lengths is not None and job.prompt_lengths[i] == len(job.sequences[i])
            and job.wants_row_outputs)
