"""The head on chunks of rows: z/T in a reused fp32 buffer, then each job's reductions cut into pieces.

Extra memory for the head is O(chunk x V/tp): the [L, V] logits never exist at once. A
chunk's rows may belong to several jobs (packed mode): one matmul for all of them at T = 1,
then each job's rows divided by its temperature, reduced (`reductions.reduce_block`) and cut
(`outputs.cut`). A job whose own work fails fails alone (`BatchRun.attempt`); when the
shared matmul fails, each job computes its own rows.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn.functional as F

from .batch_run import BatchRun
from .events import Piece, Step, pieces_of
from .loaded import LoadedModel
from .outputs import cut
from .reductions import HeadShard, Segment, reduce_block
from .spec import Job, ModelKind, OutputKind


class Head:
    """This rank's lm_head (its vocab shard under TP), or a reward model's score head."""

    def __init__(self, loaded: LoadedModel, head_shard: HeadShard, chunk_size: int, mm_fp32: bool):
        self.loaded = loaded
        self.shard = head_shard
        self.chunk_size = chunk_size
        self._mm_fp32 = mm_fp32
        self._zbuf: Optional[torch.Tensor] = None   # [chunk, V/tp] fp32, reused: fresh 64 MiB buffers cost page faults

    @torch.inference_mode()
    def logits(self, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """z/T in fp32 for a chunk of rows, in the reused buffer (valid until the next call). h: [c, H] -> [c, V/tp]."""
        head = self.loaded.head
        rows, cols = h.shape[0], head.out_features
        if self._zbuf is None or self._zbuf.shape[0] < rows:
            self._zbuf = torch.empty(max(rows, self.chunk_size), cols, dtype=torch.float32, device=h.device)
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
        if self.shard.pad_from < z.shape[-1]:
            z[:, self.shard.pad_from :] = float("-inf")
        return z

    @torch.inference_mode()
    def rows_within(self, target_s: float, most: int, hidden: int, least: int = 16) -> int:
        """The most rows (a power of two in [least, most]) whose plain logprobs step (logits and their log-sum-exp)
        took at most target_s here: timed from `least` rows up, doubling while within (the best of three each)."""
        if self.loaded.kind is not ModelKind.CAUSAL_LM:
            return most
        device, dtype = self.loaded.head.weight.device, self.loaded.head.weight.dtype
        rows, best = least, least
        while rows <= most:
            h = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype)   # [r, H]
            took = min(self._timed(h) for _ in range(3))
            if took > target_s:
                break
            best, rows = rows, rows * 2
        return min(max(best, least), most)

    def _timed(self, h: torch.Tensor) -> float:
        if h.is_cuda:
            torch.cuda.synchronize(h.device)
        t0 = time.perf_counter()
        torch.logsumexp(self.logits(h), dim=-1)
        if h.is_cuda:
            torch.cuda.synchronize(h.device)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def scores(self, last: torch.Tensor, sequences: list[int]) -> list[Piece]:
        """The reward head on each sequence's last hidden state. last: [n, H] -> n Pieces of [num_labels]."""
        scores = F.linear(last, self.loaded.head.weight, self.loaded.head.bias).float().cpu()   # [n, num_labels]
        return [Piece(OutputKind.SCORES, i, (scores.shape[1],), (0,), scores[r].contiguous())
                for r, i in enumerate(sequences)]

    @torch.inference_mode()
    def chunk_step(self, run: BatchRun, h: torch.Tensor, segs: dict[int, list[Segment]], cands: dict) -> Step:
        """One head chunk: one matmul for all its rows (none when no job of the chunk reads logits), then each job's
        pieces from its own rows. h: [c, H]; cands: job -> sequence -> [L, c] candidate ids."""
        z = None
        if any(run.jobs[j].needs_logits for j in segs):
            z = run.shared(lambda: self.logits(h))                                      # [c, V/tp] at T = 1
        events = []
        for j, job_segs in segs.items():
            events += run.attempt(j, lambda: pieces_of(j, self._job_pieces(run.jobs[j], h, z, job_segs, cands[j])))
        return Step(tuple(segs), tuple(events))

    def _job_pieces(self, job: Job, h: torch.Tensor, z: Optional[torch.Tensor], segs: list[Segment],
                    cands: dict) -> list[Piece]:
        """One job's rows of a chunk (several runs when shared prefixes interleave jobs: gathered), reduced, cut."""
        consecutive = all(a.rows.stop == b.row for a, b in zip(segs, segs[1:]))
        rows = slice(segs[0].row, segs[-1].rows.stop)
        index = None if consecutive else \
            torch.cat([torch.arange(g.rows.start, g.rows.stop) for g in segs]).to(h.device)          # [R]
        take = (lambda t: t[rows]) if consecutive else (lambda t: t.index_select(0, index))
        hj = take(h) if job.hidden_states is not None or (z is None and job.needs_logits) else None  # [R, H]
        zj = None
        if job.needs_logits:
            zj = self.logits(hj, job.temperature) if z is None else take(z)                          # [R, V/tp]
            if z is not None and (job.temperature != 1.0 or not consecutive):
                zj.div_(job.temperature)
        rebased, at = [], 0
        for g in segs:
            rebased.append(Segment(g.sequence, g.ids, g.s0, g.s1, at, g.span))
            at += g.s1 - g.s0
        return cut(reduce_block(job, zj, hj, rebased, self.shard, cands), job, rebased, self.shard)
