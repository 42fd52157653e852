"""What a validated request will cost before it runs: bytes it holds, bytes it will produce, compute it needs."""
from __future__ import annotations

from dataclasses import dataclass

from .spec import Job, WireDType

WIRE_BYTES = {WireDType.FP32: 4, WireDType.BF16: 2, WireDType.FP16: 2}
# Extra head work per row, in units of plain logprobs (one logsumexp over V): a top_p / top_k filter sorts
# the row (a top_p request measured 6.6x plain logprobs on the demo model), a top-k of k near V costs about
# two sorts, and a full-logits row is copied out whole.
FILTER_WORK = 6.0
FULL_ROW_WORK = 1.0


@dataclass(frozen=True)
class Cost:
    input_bytes: int      # the request's arrays as the server holds them (ids and candidates)
    output_bytes: int     # every output tensor's bytes, as sent
    work_tokens: int      # tokens weighted by the head's extra work per row (queue limits count these)


def _rows(job: Job, i: int) -> int:
    a, b = job.token_rows(i)
    return max(0, b - a)


def output_bytes(job: Job, vocab: int, num_labels: int = 1, hidden: int = 0) -> int:
    """Bytes of every output the job asks for, as they travel (before message framing); hidden: H."""
    total = 0
    for i, seq in enumerate(job.sequences):
        rows = _rows(job, i)
        if job.logprobs is not None:
            total += rows * (8 if job.logprobs.ranks else 4)
        if job.topk is not None:
            total += rows * job.topk.k * (WIRE_BYTES[job.topk.dtype] + 4) + (rows * 4 if job.topk.tail_mass else 0)
        if job.candidates is not None:
            total += int(job.candidates[i].size) * 4
        if job.full_logits is not None:
            s0, s1, v0, v1 = job.full_logits.bounds(len(seq), vocab)
            total += max(0, s1 - s0) * max(0, v1 - v0) * WIRE_BYTES[job.full_logits.dtype]
        if job.hidden_states is not None:
            total += rows * hidden * WIRE_BYTES[job.hidden_states.dtype]
        if job.scores:
            total += num_labels * 4
        if job.token_scores:
            total += len(seq) * num_labels * 4
        if job.step_scores is not None:
            total += int(job.step_scores.positions(seq).size) * num_labels * 4
        if job.reward_tokens is not None:
            total += len(job.reward_tokens.positions) * len(job.reward_tokens.token_ids) * 4
    return total


def input_bytes(job: Job) -> int:
    arrays = list(job.sequences) + list(job.candidates or ())
    return int(sum(a.nbytes for a in arrays))


def row_work(job: Job, vocab: int) -> float:
    """One head row's work for this job, in units of a plain logprobs row (filters and top-k sort the row)."""
    work = 1.0
    if job.logprobs is not None and (job.logprobs.top_k is not None or job.logprobs.top_p is not None):
        work += FILTER_WORK
    if job.topk is not None:
        work += FILTER_WORK * min(1.0, job.topk.k / max(vocab, 1)) * 2
    return work


def head_chunk_rows(job: Job, chunk: int, vocab: int) -> int:
    """Rows per head step for this job: `chunk` plain rows' worth of work, so that a step of a heavy job (a top-k
    near V) lasts about as long as one of plain logprobs and the scheduler can run small jobs between steps."""
    return max(1, int(chunk / row_work(job, vocab)))


def work_tokens(job: Job, vocab: int) -> int:
    """Tokens, plus each head row's extra work over plain logprobs in token units (the body's cost per token
    is about one head row on the models served here, so the units add)."""
    extra = 0.0
    for i, seq in enumerate(job.sequences):
        rows = _rows(job, i)
        if job.logprobs is not None and (job.logprobs.top_k is not None or job.logprobs.top_p is not None):
            extra += rows * FILTER_WORK
        if job.topk is not None:
            extra += rows * FILTER_WORK * min(1.0, job.topk.k / max(vocab, 1)) * 2
        if job.full_logits is not None:
            s0, s1, v0, v1 = job.full_logits.bounds(len(seq), vocab)
            extra += max(0, s1 - s0) * FULL_ROW_WORK * max(0, v1 - v0) / max(vocab, 1)
    return job.num_tokens + int(extra)


def cost_of(job: Job, vocab: int, num_labels: int = 1, hidden: int = 0) -> Cost:
    return Cost(input_bytes(job), output_bytes(job, vocab, num_labels, hidden), work_tokens(job, vocab))
