"""TRL's teacher endpoint (`trl vllm-serve`'s /get_sequence_logprobs/, json and binary) and the reward shapes.

TRL: for each sequence, positions prompt_length..L-1 (the completion), the top `top_logprobs` ids
and logprobs sorted by rank plus the realized token's; "json" gives k entries per position, or
k+1 where the realized token is outside the top-k (appended, its rank being larger); "binary"
gives base64 raw little-endian arrays [B, T, K] padded with -inf / 0, beside the realized
token's [B, T, 1], as TRL's VLLMClient decodes them. A prompt_length of 0 lists position 0 with
nothing in it, as TRL's server does. Reward models: vLLM's /classify and /pooling and SGLang's
/classify (an embedding-shaped answer), each score computed by the engine; verl's reward loop reads
/classify's data[-1].probs[-1] (older vLLM) or its logits / probabilities (newer). No math here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.spec import Job, ModelKind, OutputKind

from .http_answer import Deferred, hold_for_answer
from .http_common import Ctx, b64_array, fields, id_array, is_id_list, new_id
from .params import Param, ParamTable
from .requests import Decoded
from .reward_text import conversations, render_chat
from .scoring import ScoreSpec, json_entries, rows_of, score_job

SEQUENCE_LOGPROBS = ParamTable(
    Param("top_logprobs", int, "k of each position (TRL's default 100)", lo=1),
    Param("temperature", float, "applied to every logprob", lo=0),
    Param("response_format", str, "json or binary", choices=("JSON", "BINARY")),
)


@dataclass(frozen=True)
class SequencePlan:
    """What /get_sequence_logprobs/ decoded, for its encoding."""

    seqs: tuple                           # int32 [L] per sequence
    pls: list                             # prompt_lengths
    spec: ScoreSpec
    k: int                                # top_logprobs
    binary: bool                          # response_format binary


async def sequence_logprobs(ctx: Ctx, body: dict, client: str) -> Deferred:
    """POST /get_sequence_logprobs/: completion-token logprobs and top-k of each sequence."""
    async with ctx.pipeline.request(new_id("trl"), client) as r:
        plan, decoded = _sequence_plan(ctx, body)
        out = await ctx.collect(r, decoded)
    return Deferred(lambda: _sequence_answer(plan, r.job, out))


def _sequence_plan(ctx: Ctx, body: dict) -> tuple[SequencePlan, Decoded]:
    """What a /get_sequence_logprobs/ body asks, and its Job."""
    if ctx.loaded.kind is ModelKind.REWARD:
        raise NotSupported("sequences", "this server holds a reward model: POST /classify")
    p = fields(body, SEQUENCE_LOGPROBS)
    raw = body.get("sequences")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("sequences", "a non-empty list of token-id lists is needed")
    seqs = ctx.id_lists(raw, "sequences")
    pls = body.get("prompt_lengths")
    if not isinstance(pls, list) or len(pls) != len(seqs):
        raise InvalidRequest("prompt_lengths", f"one prompt length per sequence is needed ({len(seqs)})")
    pls = [int(id_array([x], f"prompt_lengths[{i}]")[0]) for i, x in enumerate(pls)]
    for i, (x, pl) in enumerate(zip(seqs, pls)):
        if not 0 <= pl <= len(x):
            raise InvalidRequest(f"prompt_lengths[{i}]", f"{pl} is outside [0, {len(x)}]")
    k = p.get("top_logprobs", 100)
    if k > ctx.loaded.vocab_size:
        raise InvalidRequest("top_logprobs", f"{k} is over the vocabulary size {ctx.loaded.vocab_size}")
    T = p.get("temperature", 1.0)
    spec = ScoreSpec(1.0 if T == 0 else T, logprobs=True, k=k, starts=tuple(max(pl, 1) - 1 for pl in pls))
    binary = p.get("response_format", "JSON") == "BINARY"
    if binary:      # [B, T, k] fp32 + int32 arrays, then their base64 (4/3) beside them
        hold_for_answer(json_entries(seqs, spec) * 8 * 3, "sequences: the binary answer")
    else:
        ctx.check_json_size(json_entries(seqs, spec), "sequences")
    return SequencePlan(seqs, pls, spec, k, binary), Decoded(score_job(seqs, spec), sequences_field="sequences")


def _sequence_answer(s: SequencePlan, job, out) -> dict:
    """TRL's answer, json or binary (on a worker thread)."""
    per = [rows_of(job, s.spec, out, i, len(x)) for i, x in enumerate(s.seqs)]
    # position 0 (prompt_length 0) has no distribution: one empty row in front
    lead = [1 if pl == 0 else 0 for pl in s.pls]
    if s.binary:
        return _binary(s.seqs, per, lead, s.k)
    logprobs, ids = [], []
    for x, r, z in zip(s.seqs, per, lead):
        targets = x[r.first:].tolist()
        lps, tids = [[]] * z, [[]] * z
        for j, t in enumerate(targets):
            row_ids, row_v = r.top_ids[j].tolist(), r.top_values[j].astype(np.float64).tolist()
            if t not in row_ids:     # outside the top-k: listed after them (its rank is larger)
                row_ids.append(t)
                row_v.append(float(r.logprobs[j]))
            lps.append(row_v)
            tids.append(row_ids)
        logprobs.append(lps)
        ids.append(tids)
    return {"logprobs": logprobs, "logprob_token_ids": ids}


def _binary(seqs, per, lead, k: int) -> dict:
    B = len(seqs)
    T = max(len(x) - r.first + z for x, r, z in zip(seqs, per, lead))
    lp = np.full((B, T, k), -np.inf, np.float32)
    ids = np.zeros((B, T, k), np.int32)
    act_lp = np.full((B, T, 1), -np.inf, np.float32)
    act_ids = np.zeros((B, T, 1), np.int32)
    for b, (x, r, z) in enumerate(zip(seqs, per, lead)):
        n = len(x) - r.first
        lp[b, z : z + n] = r.top_values
        ids[b, z : z + n] = r.top_ids
        act_lp[b, z : z + n, 0] = r.logprobs
        act_ids[b, z : z + n, 0] = x[r.first:]
    return {"logprobs_b64": b64_array(lp), "token_ids_b64": b64_array(ids), "actual_logprobs_b64": b64_array(act_lp),
            "actual_token_ids_b64": b64_array(act_ids), "shape": [B, T, k],
            "completion_lengths": [len(x) - r.first + z for x, r, z in zip(seqs, per, lead)]}


CLASSIFY = ParamTable(Param("model", str, "the served model's name"),
                      Param("use_activation", bool, "softmax (sigmoid for one label) of the scores; false: raw"),
                      Param("activation", bool, "older vLLM's name of use_activation (verl's reward loop sends it)"),
                      Param("softmax", bool, "older vLLM's name of use_activation"),
                      Param("add_special_tokens", bool, "text inputs: the tokenizer's special tokens (BOS)"))


async def _scores(ctx: Ctx, client: str, inputs, special: bool, where: str,
                  convs: Optional[list] = None) -> tuple[tuple, np.ndarray]:
    """(ids per input, raw scores [B, num_labels]) from the engine; `convs`: chat conversations, rendered as the
    inputs once the request is admitted."""
    async with ctx.pipeline.request(new_id("classify"), client) as r:
        if ctx.loaded.kind is ModelKind.CAUSAL_LM:     # a token classifier (PRM): its last token's scores
            raise NotSupported(where, "this server holds a causal LM: POST /v1/completions, /generate or "
                                      "/get_sequence_logprobs/")
        if convs is not None:
            inputs = await render_chat(ctx, convs, client, where)
        prompts = await ctx.prompts(inputs, where, client, "a text, token ids, or a non-empty list of either is "
                                                           "needed", special)
        out = await ctx.collect(r, Decoded(Job(sequences=prompts.seqs, scores=True), sequences_field=where,
                                           text_field=where,
                                           text_ids=prompts.seqs if prompts.texts is not None else None))
    return prompts.seqs, out.padded(OutputKind.SCORES).numpy()


def use_activation(p: dict) -> bool:
    """vLLM's use_activation, or its older names activation and softmax; on by default."""
    return next((p[n] for n in ("use_activation", "activation", "softmax") if p.get(n) is not None), True)


def activated(scores: np.ndarray) -> np.ndarray:
    s = scores.astype(np.float64)
    if s.shape[1] == 1:
        return 1.0 / (1.0 + np.exp(-s))
    e = np.exp(s - s.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _inputs(ctx: Ctx, body: dict, p: dict) -> tuple:
    """(inputs, add special tokens, field, conversations) of vLLM's completion form (`input`: texts or ids, special
    tokens by default) or its chat form (`messages`, one conversation or several, rendered with the model's chat
    template, which places the special tokens: none added by default, as vLLM's chat requests)."""
    if body.get("messages") is not None and body.get("input") is None:
        return None, p.get("add_special_tokens", False), "messages", conversations(ctx, body["messages"], "messages")
    return body.get("input"), p.get("add_special_tokens", True), "input", None


async def classify(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /classify: vLLM's shape for `input` or `messages` (each entry with older vLLM's `probs` and newer
    vLLM's `logits` and `probabilities`), SGLang's (an embedding-shaped answer) for `text` / `input_ids`."""
    if "input" not in body and "messages" not in body and ("text" in body or "input_ids" in body):
        return await _sglang_classify(ctx, body, client)
    p = fields(body, CLASSIFY)
    ctx.check_model(p.get("model"))
    seqs, raw = await _scores(ctx, client, *_inputs(ctx, body, p))
    probs = activated(raw)
    values = probs if use_activation(p) else raw.astype(np.float64)
    labels = getattr(ctx.loaded.model.config, "id2label", None) or {}
    data = [{"index": i, "label": labels.get(int(np.argmax(v)), f"LABEL_{int(np.argmax(v))}"), "probs": v.tolist(),
             "num_classes": len(v), "logits": r.astype(np.float64).tolist(), "probabilities": q.tolist()}
            for i, (v, r, q) in enumerate(zip(values, raw, probs))]
    n = sum(len(x) for x in seqs)
    return {"id": new_id("classify"), "object": "list", "created": int(time.time()), "model": ctx.model_id,
            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0,
                                    "prompt_tokens_details": None}}


async def pooling(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /pooling: vLLM's shape for `input` or `messages`; each input's (activated) scores as its data."""
    p = fields(body, CLASSIFY)
    ctx.check_model(p.get("model"))
    seqs, raw = await _scores(ctx, client, *_inputs(ctx, body, p))
    values = activated(raw) if use_activation(p) else raw.astype(np.float64)
    n = sum(len(x) for x in seqs)
    return {"id": new_id("pooling"), "object": "list", "created": int(time.time()), "model": ctx.model_id,
            "data": [{"index": i, "object": "pooling", "data": v.tolist()} for i, v in enumerate(values)],
            "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}}


async def _sglang_classify(ctx: Ctx, body: dict, client: str):
    text = body.get("text")
    inputs = text if text is not None else body.get("input_ids")
    where = "text" if text is not None else "input_ids"
    seqs, raw = await _scores(ctx, client, inputs, True, where)
    batched = isinstance(inputs, list) and not (where == "input_ids" and is_id_list(inputs))
    answers = [{"embedding": v.astype(np.float64).tolist(),
                "meta_info": {"id": new_id("sglang")[7:], "prompt_tokens": len(x), "cached_tokens": 0,
                              "weight_version": "default"}} for x, v in zip(seqs, raw)]
    return answers if batched else answers[0]
