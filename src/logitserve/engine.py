"""Runs a batch of Jobs: the model body (packed across sequences, or once per sequence), then the head chunk by chunk.

Batching modes (one per server):
- PACKED: a batch's sequences run through the body as one packed row (varlen
  attention, positions restarting per sequence), so throughput follows tokens,
  not sequence count. Results equal the per-sequence ones within fp32 rounding
  of differently shaped GEMMs (documented bound 1e-5; bitwise on CPU as measured).
- EXACT: every sequence runs alone at its exact length: bitwise batch invariance.
Under CP the body always runs per sequence (each sequence is spread over the CP ranks).
Extra memory for the head is O(chunk x V/tp): the [L, V] logits never exist at once.
The results leave as `Piece`s, rectangles of an output with their offsets,
so a caller can stream them as they come.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from .filters import apply_filters
from .context_parallel import cp_forward, head_tail
from .loading import LoadedModel
from .packing import VARLEN_ATTENTION, packed_forward, packed_positions, plan_packs, register_varlen_attention
from .parallel import ParallelContext, single_rank
from .spec import Job, OutputKind, WireDType
from .vocab_parallel import VocabShard, full_vocab, vp_gather, vp_logsumexp, vp_topk

TORCH_WIRE = {WireDType.FP32: torch.float32, WireDType.BF16: torch.bfloat16, WireDType.FP16: torch.float16}


class Batching(enum.Enum):
    """How a batch's sequences go through the model body; values equal the proto's Batching names."""

    EXACT = "exact"
    PACKED = "packed"


@dataclass(frozen=True)
class EngineConfig:
    chunk_size: int = 512                   # rows of logits materialized at a time (--logprob-chunk-size)
    batching: Batching = Batching.PACKED    # --batching
    max_pack_tokens: int = 16384            # tokens per packed body (a longer sequence packs alone)

    def __post_init__(self):
        if self.chunk_size < 1 or self.max_pack_tokens < 1:
            raise ValueError(f"chunk_size={self.chunk_size} and max_pack_tokens={self.max_pack_tokens} must be >= 1")


@dataclass(frozen=True)
class Piece:
    """One rectangle of one output of one sequence."""

    output: OutputKind
    sequence: int
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor    # contiguous, CPU, wire dtype; shape = extent of the rectangle


class Engine:
    """Owns a (possibly sharded) model and turns Jobs into Pieces on this rank.

    `steps` yields one list of Pieces per step, and every rank takes the same
    number of steps for a job, so a distributed runner can gather step by step.
    Under TP only tp_rank 0 emits the outputs every TP rank holds alike; each TP
    rank emits its own vocab columns of full-logits slices.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(),
                 shard: VocabShard | None = None, parallel: ParallelContext | None = None):
        self.loaded = loaded
        self.config = config
        self.shard = shard or full_vocab(loaded.vocab_size)
        self.parallel = parallel or single_rank(str(loaded.head.weight.device))
        self.device = loaded.head.weight.device
        self.emits_replicated = self.parallel.tp_rank == 0
        self._zbuf: torch.Tensor | None = None   # [chunk, V/tp] fp32, reused: fresh 64 MiB buffers cost page faults
        # Local columns from here on are padding (tp does not divide V): masked to -inf.
        self._pad_from = min(self.shard.size, max(0, self.shard.vocab_size - self.shard.start))
        # Packing needs each sequence whole on one rank: under CP the body runs per sequence.
        self.batching = Batching.EXACT if self.parallel.cp > 1 else config.batching
        if self.batching is Batching.PACKED:
            register_varlen_attention()
            loaded.model.set_attn_implementation(VARLEN_ATTENTION)

    # -- the model ------------------------------------------------------------
    @torch.inference_mode()
    def hidden(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Last hidden state of the body at these global positions. ids, positions: [n] -> [n, H]."""
        with cp_forward(self.parallel.cp_group, positions):
            out = self.loaded.body(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, temperature: float) -> torch.Tensor:
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
        else:   # reduced-precision models: the matmul in their dtype, upcast into the buffer
            z.copy_(F.linear(h, head.weight, head.bias))
        if temperature != 1.0:
            z.div_(temperature)
        if self._pad_from < z.shape[-1]:
            z[:, self._pad_from :] = float("-inf")
        return z

    @torch.inference_mode()
    def packed_hidden(self, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        """Last hidden state of several sequences packed in one row. ids: [N] -> [N, H]."""
        positions = packed_positions(lengths).to(self.device)                                   # [N]
        with packed_forward(lengths, self.device):
            out = self.loaded.body(input_ids=ids[None], position_ids=positions[None], use_cache=False)
        return out.last_hidden_state[0]

    # -- one job, or a batch ------------------------------------------------------
    def run(self, job: Job) -> Iterator[Piece]:
        """Every Piece this rank emits for the job, in order."""
        for _, step in self.batch_steps([job], isolate=False):
            yield from step

    def steps(self, job: Job) -> Iterator[list[Piece]]:
        """This rank's Pieces for one job run alone, step by step (exact mode's body)."""
        for i, seq in enumerate(job.sequences):
            yield from self._sequence_steps(job, i, self._ids(seq), None)

    def batch_steps(self, jobs: list[Job], skip: Optional[Callable[[int], bool]] = None,
                    isolate: bool = True) -> Iterator[tuple[int, list[Piece] | Exception]]:
        """(job index, this rank's Pieces) step by step for a whole batch, jobs in order.

        Every rank takes the same steps for the same batch. `skip(j)` drops job j (cancelled)
        from packs not yet run and from its remaining steps. With `isolate`, a job whose step
        fails yields (j, exception) once and stops; the others go on (single process only:
        ranks would fall out of step). A packed body that fails is rerun per sequence, so the
        failure lands on the job that caused it.
        """
        skip = skip or (lambda j: False)
        failed: set[int] = set()

        def guarded(j: int, steps: Iterator[list[Piece]]):
            try:
                for step in steps:
                    if skip(j):
                        return
                    yield j, step
            except Exception as e:
                if not isolate:
                    raise
                failed.add(j)
                yield j, e

        if self.batching is Batching.EXACT:
            for j, job in enumerate(jobs):
                if not skip(j):
                    yield from guarded(j, self.steps(job))
            return
        wanted = [(j, i, len(s)) for j, job in enumerate(jobs) if not skip(j) for i, s in enumerate(job.sequences)]
        for pack in plan_packs(wanted, self.config.max_pack_tokens):
            members = [m for m in pack.members if m.job not in failed and not skip(m.job)]
            if not members:
                continue
            ids = torch.cat([self._ids(jobs[m.job].sequences[m.sequence]) for m in members])   # [N]
            try:
                h = self.packed_hidden(ids, [m.length for m in members])                           # [N, H]
            except Exception:
                if not isolate:
                    raise
                h = None   # rerun per sequence below: whoever fails, fails alone
            offset = 0
            for m in members:
                if m.job in failed or skip(m.job):
                    offset += m.length
                    continue
                rows = None if h is None else h[offset : offset + m.length]
                offset += m.length
                yield from guarded(m.job, self._sequence_steps(jobs[m.job], m.sequence,
                                                               self._ids(jobs[m.job].sequences[m.sequence]), rows))

    def _ids(self, seq) -> torch.Tensor:
        return torch.from_numpy(seq.astype("int64", copy=False)).to(self.device)                 # [L]

    def _sequence_steps(self, job: Job, i: int, ids: torch.Tensor, h: Optional[torch.Tensor]) -> Iterator[list[Piece]]:
        """Steps of sequence i: per run of rows this rank holds, per chunk of rows. h: [L, H] if packed, else computed here."""
        p = self.parallel
        L = len(ids)
        positions, runs = head_tail(L, p.cp, p.cp_rank)                                         # [n_local]
        positions = positions.to(self.device)
        if h is None:
            local_ids = F.pad(ids, (0, max(0, int(positions.max()) + 1 - L)))[positions]       # [n_local]
            h = self.hidden(local_ids, positions)                                               # [n_local, H]
        if job.scores:   # from the rank holding the last position (its TP rank 0): one step either way
            holds_last = self.emits_replicated and bool((positions == L - 1).any())
            yield [self._score(i, h, positions, L)] if holds_last else []
            return
        cands = None
        if job.candidates is not None:
            cands = torch.from_numpy(job.candidates[i].astype("int64", copy=False)).to(self.device)
        chunk = self.config.chunk_size
        for run in runs:
            for c0 in range(0, run.length, chunk):
                s0 = run.start + c0                               # global rows [s0, s1) of this step
                s1 = min(run.start + min(c0 + chunk, run.length), L)
                if s0 >= s1:                                      # all padding: an empty step
                    yield []
                    continue
                rows = h[run.local + c0 : run.local + c0 + (s1 - s0)]
                yield list(self._chunk(job, i, ids, rows, s0, s1, cands))

    @torch.inference_mode()
    def _score(self, i: int, h: torch.Tensor, positions: torch.Tensor, L: int) -> Piece:
        last = h[positions == L - 1]                                                          # [1, H]
        score = F.linear(last, self.loaded.head.weight, self.loaded.head.bias).float()[0]     # [num_labels]
        return Piece(OutputKind.SCORES, i, tuple(score.shape), (0,), score.cpu().contiguous())

    @torch.inference_mode()
    def _chunk(self, job: Job, i: int, ids: torch.Tensor, h: torch.Tensor, s0: int, s1: int,
               cands: torch.Tensor | None) -> Iterator[Piece]:
        """Pieces for rows [s0, s1) of sequence i. ids: [L], h: [s1-s0, H].

        Everything that reads the raw logits runs first; the log-sum-exp runs last and
        in place, consuming the buffer, so a chunk allocates nothing of size [c, V].
        """
        L, V, shard = len(ids), self.shard.vocab_size, self.shard
        replicated = self.emits_replicated
        z = self.logits(h, job.temperature)                                         # [c, V/tp]
        pieces: list[Piece] = []
        if job.full_logits is not None:
            piece = self._slice(job, i, z, s0, s1, L, V)
            if piece is not None:
                pieces.append(piece)
        opts = job.logprobs
        wants_lp = opts is not None and (s0 == 0 or s0 + 1 < L)
        filtered = opts is not None and (opts.top_k is not None or opts.top_p is not None)
        n = min(s1, L - 1) - s0                                                     # rows with a target
        targets = ids[s0 + 1 : s0 + 1 + n, None]                                    # [n, 1]
        if wants_lp and filtered:
            kept = apply_filters(z[:n], shard, opts.top_k, opts.top_p)              # [n, V/tp], a copy
            lp = vp_gather(kept, targets, shard)[:, 0] - vp_logsumexp(kept, shard, inplace=True)
        elif wants_lp:
            target_z = vp_gather(z[:n], targets, shard)[:, 0]                       # [n]
        top = vp_topk(z, job.topk.k, shard) if job.topk is not None else None       # [c, k] x2
        cand_z = vp_gather(z, cands[s0:s1], shard) if cands is not None else None   # [c, n_cand]
        needs_lse = (wants_lp and not filtered) or (top is not None and job.topk.as_logprobs) or cand_z is not None
        lse = vp_logsumexp(z, shard, inplace=True) if needs_lse else None           # [c]; z is gone now

        if wants_lp:
            if not filtered:
                lp = target_z - lse[:n]
            pieces.append(self._token_logprobs_piece(i, lp, s0, L))
        if top is not None:
            vals, top_ids = top
            if job.topk.as_logprobs:
                vals = vals - lse[:, None]
            k = job.topk.k
            pieces.append(Piece(OutputKind.TOPK_VALUES, i, (L, k), (s0, 0), _wire(vals, job.topk.dtype)))
            pieces.append(Piece(OutputKind.TOPK_IDS, i, (L, k), (s0, 0), top_ids.to(torch.int32).cpu().contiguous()))
        if cand_z is not None:
            lp_c = cand_z - lse[:, None]                                            # [c, n_cand]
            pieces.append(Piece(OutputKind.CANDIDATE_LOGPROBS, i, tuple(cands.shape), (s0, 0), lp_c.cpu().contiguous()))
        # Under TP every rank computed the reductions; only the replicated outputs' owner emits them.
        yield from (p for p in pieces if replicated or p.output is OutputKind.FULL_LOGITS)

    @staticmethod
    def _token_logprobs_piece(i: int, lp: torch.Tensor, s0: int, L: int) -> Piece:
        """lp holds lp[t+1] for rows t in [s0, ...); lp[0] = 0 joins the first chunk."""
        start = s0 + 1
        if s0 == 0:
            lp = torch.cat([lp.new_zeros(1), lp])
            start = 0
        return Piece(OutputKind.TOKEN_LOGPROBS, i, (L,), (start,), lp.cpu().contiguous())

    def _slice(self, job: Job, i: int, z: torch.Tensor, s0: int, s1: int, L: int, V: int) -> Piece | None:
        """The part of the requested rectangle inside these rows and this rank's columns."""
        r0, r1, v0, v1 = job.full_logits.bounds(L, V)
        a, b = max(r0, s0), min(r1, s1)
        c0, c1 = max(v0, self.shard.start), min(v1, self.shard.start + self._pad_from)
        if a >= b or c0 >= c1:
            return None
        rect = z[a - s0 : b - s0, c0 - self.shard.start : c1 - self.shard.start]
        return Piece(OutputKind.FULL_LOGITS, i, (r1 - r0, v1 - v0), (a - r0, c0 - v0),
                     _wire(rect, job.full_logits.dtype))


def _wire(t: torch.Tensor, dtype: WireDType) -> torch.Tensor:
    """A fresh contiguous CPU copy in the wire dtype: never a view of the reused logits buffer."""
    out = torch.empty(t.shape, dtype=TORCH_WIRE[dtype])
    out.copy_(t)
    return out
