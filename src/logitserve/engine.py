"""Runs a batch of Jobs unit by unit: a unit's body (packed across sequences, or one sequence), then its head chunks.

Batching modes (one per server):
- PACKED: a unit's sequences run through the body as one packed row (varlen
  attention, positions restarting per sequence) and the head runs on chunks of
  that row, so throughput follows tokens, not sequence count. Results equal the
  per-sequence ones up to fp32 rounding of differently shaped GEMMs (documented
  bound 1e-5; README: Batching).
- EXACT: every sequence is a unit alone, run at its exact length, its head chunks
  starting at its own row 0: results are bitwise independent of the batch.
Under CP a unit is always one sequence (spread over the CP ranks); under PP the units
(packs) are the micro-batches that pass through the stages (logitserve.pipeline).
Units and chunks are planned in logitserve.schedule; results leave step by step as
typed events (logitserve.events).
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F

from .attention import VARLEN_ATTENTION, packed_forward, probe_flash, register_varlen_attention
from .batch_run import BatchRun
from .classify import classifier_pieces
from .context_parallel import cp_forward, head_tail
from .cost import head_chunk_rows
from .events import JobPiece, Piece, SharedTokens, Step, pieces_of
from .head import Head
from .loaded import LoadedModel
from .memory import ModelDims
from .outputs import cut
from .packing import Member, Pack, cpu_pack_tokens, packed_positions
from .parallel import ParallelContext, single_rank
from .pipeline import pipeline_steps
from .prefix import live_members, shared_by_job
from .reductions import HeadShard, Segment, empty_reductions
from .schedule import RowRun, alone, gathered_chunks, gathered_rows, grid_chunks, pack_rows, plan_units, rows_end
from .spec import Job, ModelKind
from .vocab_parallel import VocabShard, full_vocab

log = logging.getLogger("logitserve.engine")

__all__ = ["Batching", "Engine", "EngineConfig", "Piece", "SharedTokens", "Step"]


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
    step_target_s: Optional[float] = None   # head steps of fewer rows than chunk_size when a plain step of that many
                                            # takes longer here (measured at start-up); None: chunk_size (--step-target-ms)
    short_step_target_s: Optional[float] = None   # the same for a batch run in short steps (Engine.batch_steps(short=
                                            # True): small jobs keep arriving beside it); None: step_target_s's rows
                                            # (--short-step-ms)

    def __post_init__(self):
        if self.chunk_size < 1 or self.max_pack_tokens < 1 or self.min_shared_prefix < 0:
            raise ValueError(f"chunk_size={self.chunk_size} and max_pack_tokens={self.max_pack_tokens} must be >= 1, "
                             f"min_shared_prefix={self.min_shared_prefix} >= 0")


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

        mm_fp32 = loaded.head.weight.dtype != torch.float32 and accumulates_fp32(loaded.head.weight)
        probe_flash(self.device, loaded.head.weight.dtype)     # on a GPU in bf16/fp16: flash or sdpa, decided now
        # Local columns from here on are padding (tp does not divide V): masked to -inf.
        pad_from = min(self.shard.size, max(0, self.shard.vocab_size - self.shard.start))
        self.head_shard = HeadShard(self.shard, pad_from, emits_replicated=self.parallel.tp_rank == 0)
        self.head = Head(loaded, self.head_shard, config.chunk_size, mm_fp32)
        self.hidden_size = int(loaded.head.in_features)      # H: the width of HIDDEN_STATES
        self.step_rows = self._step_rows(config.step_target_s, "head steps")   # a plain head step's (heavier: fewer)
        # a batch run in short steps: rows of a plain head step then (at most step_rows)
        self.short_step_rows = self.step_rows if config.short_step_target_s is None else \
            min(self.step_rows, self._step_rows(config.short_step_target_s, "short head steps (small requests coming)"))
        self._batches = 0                          # --pp: batches running (2: one nested in another's steps)
        self.act_dtype = loaded.dtype            # activations between pipeline stages
        self.stage_input = loaded.stage_input
        self.batching = self._batching(config)
        self.pack_tokens = self._pack_tokens(config) if self.batching is Batching.PACKED else 0   # 0: exact
        # --pp: head steps in a micro-batch's first step, by the rows of its head steps
        self.pp_first_steps = self._pp_first_steps(tuple(sorted({self.step_rows, self.short_step_rows})))

    def _step_rows(self, target_s: Optional[float], what: str) -> int:
        """config.chunk_size, or the rows a plain head step computes within target_s on this device (a power of two,
        measured once now; the smallest over the ranks, so that every rank plans the same steps)."""
        config = self.config
        if target_s is None:
            return config.chunk_size
        rows = self.head.rows_within(target_s, config.chunk_size, self.hidden_size)
        if self.parallel.control_group is not None:
            agreed = torch.tensor([rows], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=self.parallel.control_group)
            rows = int(agreed.item())
        log.info("%s of %d rows at most (a plain step of that many within %.0f ms here; chunk size %d)", what, rows,
                 target_s * 1e3, config.chunk_size)
        return rows

    def _pp_first_steps(self, rows: tuple[int, ...]) -> dict[int, int]:
        """--pp: for each head step size in `rows`, how many head steps a micro-batch's first step holds, so that the
        busiest stage's body of the micro-batch `lead` ahead overlaps them (its body parameters x the micro-batch's
        tokens, over a head step's rows x V x H; the largest body over the stages, so every rank plans alike); its
        later steps hold one each."""
        if self.parallel.pp == 1:
            return dict.fromkeys(rows, 1)
        embedding = {id(p) for p in self.loaded.body.get_input_embeddings().parameters()}
        body = torch.tensor([sum(p.numel() for p in self.loaded.body.parameters() if id(p) not in embedding)],
                            dtype=torch.int64)
        torch.distributed.all_reduce(body, op=torch.distributed.ReduceOp.MAX, group=self.parallel.control_group)
        work = int(body.item()) * self.pack_tokens
        steps = {r: max(1, -(-work // max(1, r * (self.shard.vocab_size // self.parallel.tp) * self.hidden_size)))
                 for r in rows}                                                    # r x V/tp x H per head step
        log.info("--pp: a micro-batch's first step holds %s head steps (the stages' bodies overlap them)",
                 " / ".join(f"{n} of {r} rows" for r, n in steps.items()))
        return steps

    def _batching(self, config: EngineConfig) -> Batching:
        """Packing needs each sequence whole on one rank: under CP a unit is one sequence. Under PP the
        micro-batches are packs. Packed mode installs varlen attention."""
        batching = Batching.EXACT if self.parallel.cp > 1 else config.batching
        if self.parallel.pp > 1:
            batching = Batching.PACKED
        if batching is Batching.PACKED:
            sinks = [n for n, _ in self.loaded.body.named_parameters() if n.endswith(".sinks")]
            if sinks:    # gpt-oss: packed attention would have to add each head's sink logit; refuse, do not drop
                raise ValueError(f"{self.loaded.architecture} has attention sinks ({sinks[0]}, ...), which packed "
                                 f"attention does not implement: serve it with --batching exact")
            register_varlen_attention()
            self.loaded.model.set_attn_implementation(VARLEN_ATTENTION)
        return batching

    def _pack_tokens(self, config: EngineConfig) -> int:
        tokens = config.max_pack_tokens
        if self.device.type == "cpu":
            dims = ModelDims.of(self.loaded.model.config, self.shard.size, self.loaded.head.weight.element_size(),
                                self.parallel.tp)
            tokens = cpu_pack_tokens(dims.hidden, dims.intermediate, config.max_pack_tokens)
        if self.parallel.pp > 1:        # micro-batches: several per batch keep every stage busy
            tokens = min(tokens, config.pp_microbatch_tokens)
        return tokens

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

    def unit_tokens(self, jobs: list[Job], body: list[Member]) -> list[torch.Tensor]:
        """Each body member's token run; a shared prefix's tokens are the start of the sequence that continues it."""
        tokens = []
        for k, m in enumerate(body):
            src = m if m.job >= 0 else next(x for x in body[k + 1:] if x.parent == k)
            tokens.append(self._ids(jobs[src.job].sequences[src.sequence])[m.start : m.start + m.length])
        return tokens

    def unit_body(self, jobs: list[Job], body: list[Member]) -> torch.Tensor:
        """A packed unit's body: its members' last hidden states, in order. -> [N, H]"""
        return self.packed_hidden(torch.cat(self.unit_tokens(jobs, body)), [m.length for m in body],
                                  [m.start for m in body], [m.parent for m in body])

    def _ids(self, seq) -> torch.Tensor:
        return torch.from_numpy(seq.astype("int64", copy=False)).to(self.device)                 # [L]

    # -- a batch --------------------------------------------------------------
    def run(self, job: Job) -> Iterator[Piece]:
        """Every Piece this rank emits for one job run alone, in order; failures raise."""
        for step in self.batch_steps([job], isolate=False):
            yield from (e.piece for e in step.events if isinstance(e, JobPiece))

    def batch_steps(self, jobs: list[Job], skip: Optional[Callable[[int], bool]] = None,
                    isolate: bool = True, short: bool = False) -> Iterator[Step]:
        """This rank's Steps for a whole batch; `short`: in head steps of short_step_rows (every rank alike).

        `skip(j)` drops job j (cancelled) from the work not yet done. With `isolate`, a job
        whose work fails gets its JobFailed in one Step and is dropped; the others go on.
        Shared work that fails (a packed body, a head chunk of several jobs) is redone per
        sequence or job, so a failure lands on the job that caused it. Across ranks this keeps
        them in step as long as every rank raises alike for the same job (a request's own
        error); a failed collective (CollectiveFailed) is never isolated: the ranks are out of step.
        """
        p = self.parallel
        run = BatchRun(jobs, skip or (lambda j: False), isolate, across_ranks=p.config.world_size > 1,
                       reports=p.reports, step_rows=self.short_step_rows if short else self.step_rows)
        units = plan_units(jobs, run.live, self.batching is Batching.PACKED, self.pack_tokens,
                           self.config.min_shared_prefix if self.batching is Batching.PACKED else 0,
                           self.shard.vocab_size)
        if p.pp > 1:     # a batch nested between this one's steps keeps its activations apart (pipeline)
            self._batches += 1
            try:
                yield from pipeline_steps(self, run, units, nested=self._batches > 1)
            finally:
                self._batches -= 1
            return
        last = {m.job: k for k, unit in enumerate(units) for m in unit.members if m.job >= 0}   # job -> its last unit
        for k, unit in enumerate(units):
            yield from self._unit_steps(run, unit, frozenset(j for j, u in last.items() if u == k))

    def _unit_steps(self, run: BatchRun, unit: Pack, ending: frozenset = frozenset()) -> Iterator[Step]:
        """A unit's steps, isolated here and only here: when its body fails, a unit of several sequences is redone
        sequence by sequence, each a unit of its own, so whoever fails fails alone; a failure in the work of one
        job alone is that job's (JobFailed). A head chunk's jobs fail alone within it (Head.chunk_step)."""
        body = live_members(unit, run.live)
        members = [m for m in body if m.job >= 0]
        jobs = tuple(dict.fromkeys(m.job for m in members))
        started = False
        try:
            for step in self._unit_work(run, body, ending):
                started = True
                yield step
                if len(jobs) == 1 and not run.live(jobs[0]):
                    return
        except Exception as e:
            if started or len(members) == 1:
                if len(jobs) != 1:
                    raise
                yield Step(jobs, run.fail(jobs[0], e))
                return
            run.reraise_unless_isolated(e)
            for m in members:
                if run.live(m.job):
                    yield from self._unit_steps(run, alone(m.job, m.sequence, len(run.jobs[m.job].sequences[m.sequence])))

    def _unit_work(self, run: BatchRun, body: list[Member], ending: frozenset) -> Iterator[Step]:
        if not any(m.job >= 0 for m in body):
            return
        if self.batching is Batching.PACKED:
            h = self.unit_body(run.jobs, body)                                                   # [N, H]
            yield from self._after_body(run, body, len(h))
            yield from self.head_steps(run, body, h, pack_rows(body), ending)
            return
        m = body[0]                                     # exact: one sequence, spread over the CP ranks
        p = self.parallel
        ids = self._ids(run.jobs[m.job].sequences[m.sequence])                                 # [L]
        positions, runs = head_tail(len(ids), p.cp, p.cp_rank)                                 # [n_local]
        positions = positions.to(self.device)
        local_ids = F.pad(ids, (0, max(0, int(positions.max()) + 1 - len(ids))))[positions]    # [n_local]
        h = self.hidden(local_ids, positions)                                                  # [n_local, H]
        yield from self._after_body(run, body, len(ids))
        yield from self.head_steps(run, body, h, [RowRun(0, r.local, r.start, r.length) for r in runs], ending)

    def _after_body(self, run: BatchRun, body: list[Member], tokens: int) -> Iterator[Step]:
        """A step boundary between a long body (more tokens than a head step's rows) and its head, so that the
        scheduler may run queued small jobs there; the same on every rank (`tokens`: the whole body's)."""
        if tokens > run.step_rows:
            yield Step(tuple(dict.fromkeys(m.job for m in body if m.job >= 0)))

    # -- the head of a unit ------------------------------------------------------
    def head_steps(self, run: BatchRun, body: list[Member], h: torch.Tensor, runs: list[RowRun],
                   ending: frozenset = frozenset()) -> Iterator[Step]:
        """A unit's head steps, its body's hidden states h [N, H] in hand (the last pipeline stage gets them from
        the stage before): shared tokens and empty outputs, then scores or the head chunks. `ending`: the jobs
        whose last unit this is; each step names in `done` those it completes (their streams may end there)."""
        jobs = run.jobs
        members = [m for m in body if m.job >= 0]
        ids = {(m.job, m.sequence): self._ids(jobs[m.job].sequences[m.sequence]) for m in members}
        opening = self._opening(run, body, ids)
        if opening is not None:
            yield opening
        if self.loaded.kind is not ModelKind.CAUSAL_LM:   # reward models: every job wants the classifier's outputs
            step = self._classifier_step(run, body, h, runs)
            yield dataclasses.replace(step, done=tuple(j for j in step.jobs if j in ending))
            return
        cands = {j: self._cands(jobs[j], [m.sequence for m in members if m.job == j])
                 for j in dict.fromkeys(m.job for m in members)}
        V = self.shard.vocab_size
        if self.batching is Batching.EXACT:
            m = members[0]
            rows = head_chunk_rows(jobs[m.job], run.step_rows, V)      # a function of the job and the batch
            chunks = list(grid_chunks(m.job, jobs[m.job], m, ids[(m.job, m.sequence)], runs, rows, V))
            for k, chunk in enumerate(chunks):
                step = Step((m.job,)) if chunk.rows is None else self.head.chunk_step(run, h[chunk.rows], chunk.segs,
                                                                                       cands)
                yield dataclasses.replace(step, done=(m.job,)) if k == len(chunks) - 1 and m.job in ending else step
            return
        index, picked = gathered_rows(jobs, body, runs, V)
        if index is not None:
            h = h.index_select(0, index.to(h.device))                                          # [M, H]
        rows = self._packed_head_rows(run, members)
        ends = rows_end(picked, ending)                     # job -> the end of its last rows among the selected
        for chunk in gathered_chunks(jobs, picked, ids, rows, run.live):
            step = self.head.chunk_step(run, h[chunk.rows], chunk.segs, cands)
            done = tuple(j for j, end in ends.items() if chunk.rows.start < end <= chunk.rows.stop)
            yield dataclasses.replace(step, done=done) if done else step

    def head_step_bound(self, run: BatchRun, body: list[Member]) -> int:
        """The most Steps head_steps yields for a packed unit (with every job live; fewer once some are dropped),
        from the jobs alone: what every pipeline stage plans for a micro-batch, hidden states or not."""
        jobs, V = run.jobs, self.shard.vocab_size
        members = [m for m in body if m.job >= 0]
        opening = int(bool(shared_by_job(body)) or any(_span_is_empty(jobs[m.job], m.sequence) for m in members))
        if not members:
            return opening
        if self.loaded.kind is not ModelKind.CAUSAL_LM:
            return opening + 1
        total = sum(hi - lo for lo, hi in (jobs[m.job].head_rows(m.sequence, V) for m in members))
        return opening + -(-total // self._packed_head_rows(run, members))

    def _packed_head_rows(self, run: BatchRun, members: list[Member]) -> int:
        """Rows of a packed unit's head steps: the fewest any of its jobs takes (a heavier job's rows are fewer)."""
        return min(head_chunk_rows(run.jobs[m.job], run.step_rows, self.shard.vocab_size) for m in members)

    def _opening(self, run: BatchRun, body: list[Member], ids: dict) -> Optional[Step]:
        """A unit's first step when it has one: tokens its sequences share (from the reporting rank) and the empty
        outputs of sequences with nothing to predict (from CP rank 0's TP rank 0). A Step on every rank alike."""
        shared = shared_by_job(body)
        events = [SharedTokens(j, n) for j, n in shared] if run.reports else []
        spanless = [m for m in body if m.job >= 0 and _span_is_empty(run.jobs[m.job], m.sequence)]
        for m in spanless if self.parallel.cp_rank == 0 else ():
            job = run.jobs[m.job]
            span = job.token_rows(m.sequence)                                # (P - 1, L - 1): no rows
            seg = [Segment(m.sequence, ids[(m.job, m.sequence)], span[0], span[0], 0, span)]
            red = empty_reductions(job, seg, self.hidden_size)
            events += pieces_of(m.job, cut(red, job, seg, self.head_shard))
        jobs = tuple(dict.fromkeys([j for j, _ in shared] + [m.job for m in spanless]))
        return Step(jobs, tuple(events)) if jobs else None

    def _classifier_step(self, run: BatchRun, body: list[Member], h: torch.Tensor, runs: list[RowRun]) -> Step:
        """A reward model's head outputs (scores, token and step scores) at the positions this rank's rows hold,
        emitted by its TP rank 0 (logitserve.classify): one Step on every rank."""
        events = classifier_pieces(run.jobs, body, h, runs, self.loaded.head) if self.head_shard.emits_replicated \
            else []
        return Step(tuple(dict.fromkeys(m.job for m in body if m.job >= 0)), tuple(events))

    def _cands(self, job: Job, sequences) -> dict[int, torch.Tensor]:
        """Candidate ids of these sequences of the job: sequence -> [L, c] (empty when the job asks for none)."""
        if job.candidates is None:
            return {}
        return {i: self._ids(job.candidates[i]) for i in sequences}


def _span_is_empty(job: Job, i: int) -> bool:
    """prompt_lengths P = L: nothing to predict, yet every token output asked for must arrive (empty)."""
    return (job.prompt_lengths is not None and job.prompt_lengths[i] == len(job.sequences[i])
            and job.wants_row_outputs)
