"""SGLang's native shapes: POST /generate input logprobs (slime's teacher call), model info, /classify.

`meta_info.input_token_logprobs` holds one [logprob, id, text] per prompt token from
logprob_start_len on, the first with a null logprob (SGLang never scores the token at the start);
`input_top_logprobs` and `input_token_ids_logprobs` likewise, null first. The default start (-1)
is the last prompt token, as SGLang's scheduler sets it. Differences, on purpose: temperature is
applied (0 means 1), max_new_tokens is 0 or 1 (greedy; absent means 0), and one request holds one
temperature. No math here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.spec import ModelKind

from .http_answer import Deferred
from .http_common import Ctx, Prompts, check_request_id, clamp, fields, id_array, new_id
from .params import Param, ParamTable
from .requests import Decoded
from .scoring import ScoreSpec, json_entries, rows_of, score_job

GENERATE = ParamTable(
    Param("return_logprob", bool, "input_token_logprobs (and output ones)"),
    Param("logprob_start_len", int, "first prompt position listed; -1: the last one", lo=-1),
    Param("top_logprobs_num", int, "k of input_top_logprobs", lo=0),
    Param("return_text_in_logprobs", bool, "each entry's token text"),
    Param("stream", bool, "false: the answer comes whole"),
    Param("rid", str, "request id"),
)
SAMPLING = ParamTable(
    Param("max_new_tokens", int, "0 or 1 (the greedy next token)", lo=0),
    Param("temperature", float, "applied to every logprob; 0 means 1", lo=0),
)


def _per_item(value: Any, n: int, field: str) -> list:
    """A scalar broadcast to n items, or a list of n."""
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequest(field, f"{len(value)} values for {n} inputs")
        return value
    return [value] * n


async def _inputs(ctx: Ctx, body: dict, client: str) -> Prompts:
    """The inputs of `input_ids` (a list of ids or of id lists) or `text` (a text or a list of texts)."""
    ids, text = body.get("input_ids"), body.get("text")
    if (ids is None) == (text is None):
        raise InvalidRequest("input_ids", "set exactly one of input_ids and text")
    if text is not None:
        return await ctx.prompts(text, "text", client, "a text or a non-empty list of texts is needed", ids=False)
    return await ctx.prompts(ids, "input_ids", client, "a list of token ids, or a non-empty list of them, is needed",
                             texts=False)


def _sampling(body: dict, n: int) -> tuple[float, int]:
    sp = body.get("sampling_params") or {}
    items = sp if isinstance(sp, list) else [sp]
    if not all(isinstance(x, dict) for x in items) or (isinstance(sp, list) and len(sp) != n):
        raise InvalidRequest("sampling_params", "an object (or one per input) is needed")
    read = [fields(x, SAMPLING, "sampling_params.", strict=True) for x in items]
    temps = {1.0 if r.get("temperature", 1.0) == 0 else r.get("temperature", 1.0) for r in read}
    gens = {r.get("max_new_tokens", 0) for r in read}
    if len(temps) > 1:
        raise InvalidRequest("sampling_params.temperature", "one temperature per request; send one request each")
    gen = max(gens)
    if gen > 1 or len(gens) > 1:
        raise InvalidRequest("sampling_params.max_new_tokens", f"{gen}: this server scores inputs and returns at "
                                                               f"most the greedy next token (0 or 1, the same for all)")
    return temps.pop(), gen


def _triples(values, ids, texts) -> list:
    return [[v, i, t] for v, i, t in zip(values, ids, texts)]


@dataclass(frozen=True)
class GeneratePlan:
    """What /generate decoded, for its encoding."""

    seqs: tuple                           # int32 [L] per input
    batched: bool                         # a list of inputs (answered with a list)
    spec: ScoreSpec
    want: bool                            # return_logprob
    k: int                                # top_logprobs_num
    cands: Optional[list]                 # token_ids_logprob per input
    texts: bool                           # return_text_in_logprobs
    starts: list                          # logprob_start_len per input, resolved


async def generate(ctx: Ctx, body: dict, client: str) -> Deferred:
    """POST /generate with max_new_tokens 0 (or 1): SGLang's meta_info input logprobs per input."""
    async with ctx.pipeline.request(new_id("sglang"), client) as r:
        plan, decoded = await _generate_plan(ctx, body, client)
        out = await ctx.collect(r, decoded)
    return Deferred(lambda: _generate_answer(ctx, plan, r.job, out))


async def _generate_plan(ctx: Ctx, body: dict, client: str) -> tuple[GeneratePlan, Decoded]:
    """What a /generate body asks, and its Job."""
    if ctx.loaded.kind is ModelKind.REWARD:
        raise NotSupported("input_ids", "this server holds a reward model: POST /classify")
    p = fields(body, GENERATE)
    check_request_id(p.get("rid"), "rid")
    if p.get("stream"):
        raise InvalidRequest("stream", "this server answers whole; set stream to false")
    inputs = await _inputs(ctx, body, client)
    seqs = inputs.seqs
    T, gen = _sampling(body, len(seqs))
    want = p.get("return_logprob", False)
    given = _per_item(p.get("logprob_start_len"), len(seqs), "logprob_start_len") if want else [-1] * len(seqs)
    starts = [len(x) - 1 if s in (None, -1) else s for x, s in zip(seqs, given)]
    for i, (x, s) in enumerate(zip(seqs, starts)):
        if s > len(x):
            raise InvalidRequest("logprob_start_len", f"{s} is over input {i}'s length {len(x)}")
    k = p.get("top_logprobs_num", 0) if want else 0
    cand_ids = body.get("token_ids_logprob") if want else None
    per = ctx.candidate_lists(cand_ids, len(seqs), "token_ids_logprob") if cand_ids else None
    # nothing asked and nothing generated: the last position's logprob, zero rows of head work
    spec = ScoreSpec(T, logprobs=want or not gen, k=k, generate=bool(gen), starts=tuple(starts))
    # every position's candidates count in the answer's size, checked before they are expanded
    ctx.check_json_size(json_entries(seqs, spec, len(per[0]) if per else 0), "input_token_logprobs")
    if per:
        spec = dataclasses.replace(spec, candidates=tuple(
            np.tile(id_array(c, "token_ids_logprob"), (max(len(x) - 1 - s, 0), 1))
            for c, x, s in zip(per, seqs, starts)))
    plan = GeneratePlan(seqs, inputs.batched, spec, want, k, per, p.get("return_text_in_logprobs", False), starts)
    return plan, Decoded(score_job(seqs, spec), sequences_field="input_ids",
                         temperature_field="sampling_params.temperature")


def _generate_answer(ctx: Ctx, s: GeneratePlan, job, out):
    """SGLang's answer per input (on a worker thread)."""
    answers = []
    for i, x in enumerate(s.seqs):
        L, start = len(x), s.starts[i]
        rows = rows_of(job, s.spec, out, i, L)
        text_of = ctx.texts.of if s.texts else (lambda ids: [None] * len(ids))
        meta = {"id": new_id("sglang")[7:], "finish_reason": {"type": "length", "length": int(s.spec.generate)},
                "prompt_tokens": L, "completion_tokens": int(s.spec.generate), "cached_tokens": 0,
                "weight_version": "default"}
        output_ids, text = [], ""
        if s.spec.generate:
            g = int(rows.next_ids[0])
            output_ids, text = [g], ctx.texts.of([g])[0] or ""
        if s.want:
            listed = x[start:L].tolist()
            meta["input_token_logprobs"] = _triples([None] + clamp(rows.logprobs), listed, text_of(listed)) \
                if listed else []
            out_lp = []
            if output_ids:
                out_lp = _triples(clamp(rows.next_values[:1]), output_ids, text_of(output_ids))
            meta["output_token_logprobs"] = out_lp
            if s.k:
                tops = [None] + [_triples(clamp(v), ids, text_of(ids)) for v, ids in
                                 zip(rows.top_values, rows.top_ids.tolist())]
                meta["input_top_logprobs"] = tops if listed else []
                meta["output_top_logprobs"] = [_triples(clamp(rows.next_values[: s.k]), rows.next_ids[: s.k]
                                                        .tolist(), text_of(rows.next_ids[: s.k].tolist()))] \
                    if output_ids else []
            if s.cands:
                ids = [int(c) for c in s.cands[i]]
                meta["input_token_ids_logprobs"] = ([None] + [_triples(clamp(v), ids, text_of(ids))
                                                              for v in rows.candidates]) if listed else []
        answers.append({"text": text, "output_ids": output_ids, "meta_info": meta})
    return answers if s.batched else answers[0]


def model_info(ctx: Ctx) -> dict:
    """GET /get_model_info (and /model_info)."""
    return {"model_path": ctx.model_id, "tokenizer_path": ctx.model_id if ctx.texts.available else None,
            "is_generation": ctx.loaded.kind is ModelKind.CAUSAL_LM, "preferred_sampling_params": None,
            "weight_version": "default", "architectures": [ctx.loaded.architecture]}
