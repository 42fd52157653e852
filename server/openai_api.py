"""vLLM's OpenAI-compatible shapes: /v1/completions prompt_logprobs, /inference/v1/generate, models, tokenize.

Responses are shaped as vLLM 0.32's server shapes them (captured from it): `prompt_logprobs` a list
with null first, then per token a dict keyed by token-id strings, the prompt token first with its
true rank, then the top-k by rank (k or k+1 entries); the OpenAI `logprobs` block with echo;
`usage`; errors as {"error": {message, type, param, code}}. Differences, on purpose: temperature
is applied to every logprob (vLLM ignores it for prompt logprobs; 0, greedy for generation,
means 1 here), k is not capped, max_tokens is 0 or 1 (the greedy next token), max_tokens 0 works
without echo, and out-of-vocabulary ids in /detokenize are refused, not dropped. No math here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.spec import ModelKind
from logitserve.validate import check_candidates_per_row

from .http_answer import Deferred, Streamed, encoded_apart
from .http_common import Ctx, check_request_id, clamp, detokenize_ids, fields, id_array, new_id, npy_b64, request_id
from .json_logprobs import prompt_logprobs_parts
from .params import Param, ParamTable
from .requests import Decoded
from .scoring import ScoreSpec, json_entries, rows_of, score_job

COMPLETIONS = ParamTable(
    Param("model", str, "the served model's name (GET /v1/models); absent: the one served"),
    Param("echo", bool, "the prompt's tokens and logprobs in the OpenAI logprobs block"),
    Param("max_tokens", int, "0 or 1: the greedy next token after the prompt", lo=0),
    Param("logprobs", int, "k of the OpenAI logprobs block; -1: the whole vocabulary", lo=-1),
    Param("prompt_logprobs", int, "k of prompt_logprobs; -1: the whole vocabulary", lo=-1),
    Param("prompt_logprob_start", int, "score tokens start+1.. only (vLLM PR #54335); earlier entries are null",
          lo=0),
    Param("temperature", float, "applied to every logprob; 0 means 1 (vLLM's greedy)", lo=0),
    Param("n", int, "1: one choice per prompt", lo=1, hi=1),
    Param("stream", bool, "false: the answer comes whole"),
    Param("add_special_tokens", bool, "text prompts: the tokenizer's special tokens (BOS)"),
    Param("return_token_ids", bool, "each choice's prompt_token_ids and token_ids"),
)
GENERATE = ParamTable(
    Param("model", str, "the served model's name"),
    Param("request_id", str, "echoed as request_id"),
    Param("return_token_ids", bool, "prompt_token_ids in the answer"),
    Param("stream", bool, "false: the answer comes whole"),
)
SAMPLING = ParamTable(
    Param("max_tokens", int, "0 or 1: the greedy next token", lo=0),
    Param("temperature", float, "applied to every logprob; 0 means 1", lo=0),
    Param("prompt_logprobs", int, "k of prompt_logprobs; -1: the whole vocabulary", lo=-1),
    Param("logprobs", int, "k of the generated token's top_logprobs; -1: all", lo=-1),
    Param("prompt_logprob_start", int, "score tokens start+1.. only", lo=0),
    Param("n", int, "1", lo=1, hi=1),
)


def _k(value: Optional[int], vocab: int) -> Optional[int]:
    return None if value is None else (vocab if value == -1 else value)


def _ks(p: dict, vocab: int, where: str = "") -> tuple[Optional[int], Optional[int]]:
    """(prompt_logprobs k, logprobs k) of typed fields, -1 as V; a k over V is refused naming the field."""
    ks = []
    for name in ("prompt_logprobs", "logprobs"):
        k = _k(p.get(name), vocab)
        if k is not None and k > vocab:
            raise InvalidRequest(where + name, f"{k} is over the vocabulary size {vocab}; use -1 for every token")
        ks.append(k)
    return ks[0], ks[1]


def _temperature(t: Optional[float]) -> float:
    return 1.0 if t is None or t == 0 else t


def _generate_count(max_tokens: Optional[int]) -> int:
    n = 1 if max_tokens is None else max_tokens
    if n > 1:
        raise InvalidRequest("max_tokens", f"{n}: this server scores prompts and returns at most the greedy next "
                                           f"token (max_tokens 0 or 1); sample from a generation server")
    return n


def _not_reward(ctx: Ctx, where: str) -> None:
    if ctx.loaded.kind is ModelKind.REWARD:
        raise NotSupported(where, "this server holds a reward model: POST /classify or /pooling (vLLM's shapes), "
                                  "/classify with text or input_ids (SGLang's), or the gRPC scores output")


def _prompt_dicts(seq: np.ndarray, rows, k: int, ctx: Ctx, L: int) -> list:
    """vLLM's per-token dicts for tokens rows.first..L-1: the token first (its rank), then the top-k by rank."""
    n = L - rows.first
    lp, rk = clamp(rows.logprobs), rows.ranks.tolist()
    top_ids = rows.top_ids[:, :k].tolist() if k else [[]] * n
    top_v = clamp(rows.top_values[:, :k]) if k else [[]] * n
    targets = seq[rows.first:L].tolist()
    text = dict(zip(*_texts(ctx, targets, top_ids)))
    out = []
    for j in range(n):
        x = targets[j]
        d = {str(x): {"logprob": lp[j], "rank": rk[j], "decoded_token": text[x]}}
        for r, (y, v) in enumerate(zip(top_ids[j], top_v[j])):
            if y != x:
                d[str(y)] = {"logprob": v, "rank": r + 1, "decoded_token": text[y]}
        out.append(d)
    return out


def _prompt_json(seq: np.ndarray, rows, k: int, ctx: Ctx, L: int) -> Streamed:
    """The same list as [None] * first + _prompt_dicts, as JSON bytes built column-wise (json_logprobs), a block
    of rows at a time while the answer is sent; a list over QUICK_BYTES by the encoding process."""
    top_ids = rows.top_ids[:, :k].astype(np.int64) if k else None
    top_v = rows.top_values[:, :k] if k else None
    args = (seq[rows.first:L].astype(np.int64), rows.logprobs, rows.ranks, top_ids, top_v, rows.first)
    if encoded_apart(len(rows.logprobs) * (k + 1)):     # bulk: encoded in a process of its own
        return Streamed(lambda: ctx.encoder.parts(*args))
    return Streamed(lambda: prompt_logprobs_parts(*args, ctx.tables))


def _texts(ctx: Ctx, targets: list, top_ids: list) -> tuple[list, list]:
    ids = sorted(set(targets).union(*map(set, top_ids)) if top_ids else set(targets))
    return ids, ctx.texts.of(ids)


def _next_dict(rows, k: int, ctx: Ctx) -> tuple[int, dict]:
    """The greedy next token and its step dict (it is rank 1, so k entries)."""
    ids, vals = rows.next_ids[: max(k, 1)].tolist(), clamp(rows.next_values[: max(k, 1)])
    texts = ctx.texts.of(ids)
    return ids[0], {str(y): {"logprob": v, "rank": r + 1, "decoded_token": t}
                    for r, (y, v, t) in enumerate(zip(ids, vals, texts))}


def _openai_block(tokens: list, steps: list, k: int, offset0: int = 0) -> dict:
    """The OpenAI logprobs block from step dicts (None for position 0): at most k + 1 entries each, text keys."""
    token_logprobs, top = [], []
    for tok, step in zip(tokens, steps):
        if step is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        items = list(step.values())
        token_logprobs.append(items[0]["logprob"])
        top.append({e["decoded_token"]: e["logprob"] for e in items[: k + 1]})
    offsets, at = [], offset0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


@dataclass(frozen=True)
class CompletionsPlan:
    """What /v1/completions decoded, for its encoding: the typed fields, the prompts and what to list."""

    p: dict                               # the request's typed fields (COMPLETIONS)
    seqs: tuple                           # int32 [L] per prompt
    texts: Optional[list]                 # the prompts' texts, when sent as text
    spec: ScoreSpec
    prompt_k: Optional[int]               # k of prompt_logprobs (None: not asked)
    sample_k: Optional[int]               # k of the OpenAI logprobs block (None: not asked)
    echo: bool


async def completions(ctx: Ctx, body: dict, client: str) -> Deferred:
    """POST /v1/completions: prompt logprobs (and at most the greedy next token) for each prompt."""
    rid = new_id("cmpl")                      # the answer's id is the access log's request id
    async with ctx.pipeline.request(rid, client) as r:
        plan, decoded = await _completions_plan(ctx, body, client)
        out = await ctx.collect(r, decoded)
    return Deferred(lambda: _completions_answer(ctx, plan, rid, r.job, out))


async def _completions_plan(ctx: Ctx, body: dict, client: str) -> tuple[CompletionsPlan, Decoded]:
    """What a /v1/completions body asks, and its Job."""
    _not_reward(ctx, "model")
    p = fields(body, COMPLETIONS)
    ctx.check_model(p.get("model"))
    prompt_k, sample_k = _ks(p, ctx.loaded.vocab_size)
    if p.get("stream"):
        why = ("`prompt_logprobs` are not available when `stream=True`" if prompt_k else
               "this server answers whole (prompt scoring has nothing to stream); set stream to false")
        raise InvalidRequest("prompt_logprobs" if prompt_k else "stream", why)
    echo = p.get("echo", False)
    if prompt_k is None and echo:          # vLLM: echo with logprobs turns prompt logprobs on
        prompt_k = sample_k
    gen = _generate_count(p.get("max_tokens"))
    prompt = body.get("prompt")       # vLLM's: ids, a list of id lists, a text or a list of texts
    if prompt is None or prompt == "" or prompt == []:
        raise InvalidRequest("prompt", "a prompt is needed: token ids, a list of them, a text or a list of texts")
    prompts = await ctx.prompts(prompt, "prompt", client, f"token ids, a list of them, a text or a list of texts; "
                                                          f"got {type(prompt).__name__}", p.get("add_special_tokens", True))
    seqs, start = prompts.seqs, p.get("prompt_logprob_start")
    spec = ScoreSpec(_temperature(p.get("temperature")), logprobs=prompt_k is not None,
                     k=max(prompt_k or 0, sample_k or 0), generate=bool(gen),
                     starts=None if start is None else (start,) * len(seqs))
    ctx.check_json_size(json_entries(seqs, spec), "prompt_logprobs", streamed=not (echo and sample_k is not None))
    plan = CompletionsPlan(p, seqs, prompts.texts, spec, prompt_k, sample_k, echo)
    return plan, Decoded(score_job(seqs, spec), sequences_field="prompt",
                         text_ids=seqs if prompts.texts is not None else None, text_field="prompt")


def _completions_answer(ctx: Ctx, s: CompletionsPlan, rid: str, job, out) -> dict:
    """The /v1/completions answer (on a worker thread; prompt_logprobs produced while it is sent)."""
    choices, prompt_tokens, gen = [], 0, int(s.spec.generate)
    for i, seq in enumerate(s.seqs):
        L = len(seq)
        prompt_tokens += L
        steps: list = [None] * L
        prompt_lp = None
        rows = rows_of(job, s.spec, out, i, L)
        if s.prompt_k is not None:
            prompt_lp = _prompt_json(seq, rows, s.prompt_k, ctx, L)
            if s.echo and s.sample_k is not None:      # the OpenAI block reads the same step dicts
                steps[rows.first:] = _prompt_dicts(seq, rows, s.prompt_k, ctx, L)
        text, token_ids = "", []
        tokens, block_steps = [], []
        head = ctx.texts.decode(seq) if s.echo or gen else ""      # the prompt as text, decoded once
        if s.echo:
            text = s.texts[i] if s.texts is not None else head
            tokens, block_steps = ctx.texts.of(seq), list(steps)
        if gen:
            g, step = _next_dict(rows, s.sample_k or 0, ctx)
            token_ids = [g]
            whole = ctx.texts.decode(np.append(seq, g))
            text += whole[len(head):] if whole.startswith(head) else ctx.texts.of([g])[0]
            tokens.append(ctx.texts.of([g])[0])
            block_steps.append(step)
        logprobs = None
        if s.sample_k is not None and tokens:
            logprobs = _openai_block(tokens, block_steps, s.sample_k)
        ret_ids = s.p.get("return_token_ids")
        choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": "length",
                        "stop_reason": None, "token_ids": token_ids if ret_ids else None,
                        "prompt_logprobs": prompt_lp, "prompt_token_ids": seq.tolist() if ret_ids else None})
    n = len(s.seqs)
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": ctx.model_id,
            "choices": choices, "service_tier": None, "system_fingerprint": f"logitserve-{ctx.version}",
            "usage": _usage(prompt_tokens, gen * n)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None, "completion_tokens_details": None}


def _token_id_rows(value: Any, rows: int, vocab: int) -> np.ndarray:
    """sampling_params.prompt_logprob_token_ids: one list of candidate ids per scored row, [rows, c] int32."""
    field = "sampling_params.prompt_logprob_token_ids"
    if not isinstance(value, list) or len(value) != rows or not all(isinstance(r, list) for r in value):
        raise InvalidRequest(field, f"one list of token ids per scored row is needed ({rows} rows)")
    widths = {len(r) for r in value}
    if len(widths) > 1 or 0 in widths:
        raise InvalidRequest(field, "every row needs the same number (>= 1) of token ids")
    check_candidates_per_row(field, widths.pop() if widths else 0, vocab)
    return np.stack([id_array(r, f"{field}[{j}]") for j, r in enumerate(value)]) if rows else \
        np.zeros((0, 1), np.int32)


@dataclass(frozen=True)
class GeneratePlan:
    """What /inference/v1/generate decoded, for its encoding."""

    p: dict                               # the request's typed fields (GENERATE)
    seq: np.ndarray                       # int32 [L]
    spec: ScoreSpec
    prompt_k: Optional[int]
    sample_k: Optional[int]


async def generate(ctx: Ctx, body: dict, client: str) -> Deferred:
    """POST /inference/v1/generate (prime-rl's call): token_ids and sampling_params in, vLLM's answer out."""
    rid = request_id(body, "request_id", "generate-tokens")     # bounded: a longer one is refused in the plan
    async with ctx.pipeline.request(rid, client) as r:
        plan, decoded = _generate_plan(ctx, body)
        out = await ctx.collect(r, decoded)
    return Deferred(lambda: _generate_answer(ctx, plan, rid, r.job, out))


def _generate_plan(ctx: Ctx, body: dict) -> tuple[GeneratePlan, Decoded]:
    """What an /inference/v1/generate body asks, and its Job."""
    _not_reward(ctx, "model")
    p = fields(body, GENERATE)
    check_request_id(p.get("request_id"), "request_id")
    ctx.check_model(p.get("model"))
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise InvalidRequest("sampling_params", "an object is needed (vLLM's SamplingParams)")
    s = fields(sp, SAMPLING, "sampling_params.", strict=True, also=("prompt_logprob_token_ids",))
    if p.get("stream"):
        raise InvalidRequest("stream", "this server answers whole; set stream to false")
    V = ctx.loaded.vocab_size
    prompt_k, sample_k = _ks(s, V, "sampling_params.")
    seq = ctx.ids(body.get("token_ids"), "token_ids")
    if not len(seq):
        raise InvalidRequest("token_ids", "at least one token id is needed")
    gen = _generate_count(s.get("max_tokens"))
    start = s.get("prompt_logprob_start")
    cands = None
    if sp.get("prompt_logprob_token_ids") is not None:
        start = start or 0
        cands = (_token_id_rows(sp["prompt_logprob_token_ids"], max(len(seq) - 1 - start, 0), V),)
    spec = ScoreSpec(_temperature(s.get("temperature")), logprobs=prompt_k is not None, k=max(prompt_k or 0,
                     sample_k or 0), generate=bool(gen), starts=None if start is None else (start,),
                     candidates=cands)
    ctx.check_json_size(json_entries((seq,), spec), "prompt_logprobs", streamed=True)
    return GeneratePlan(p, seq, spec, prompt_k, sample_k), Decoded(score_job((seq,), spec), sequences_field="token_ids",
                                                                 temperature_field="sampling_params.temperature")


def _generate_answer(ctx: Ctx, s: GeneratePlan, rid: str, job, out) -> dict:
    """The /inference/v1/generate answer (on a worker thread)."""
    seq, L = s.seq, len(s.seq)
    rows = rows_of(job, s.spec, out, 0, L)
    prompt_lp = None
    if s.prompt_k is not None:
        prompt_lp = _prompt_json(seq, rows, s.prompt_k, ctx, L)
    token_ids, logprobs = [], None
    if s.spec.generate:
        g, step = _next_dict(rows, s.sample_k or 0, ctx)
        token_ids = [g]
        if s.sample_k is not None:
            top = [{"token_id": int(y), "logprob": e["logprob"], "rank": e["rank"]}
                   for y, e in list(step.items())[: s.sample_k + 1]]
            logprobs = {"content": [{"token_id": g, "logprob": top[0]["logprob"], "rank": 1,
                                     "top_logprobs": top[: max(s.sample_k, 1)] if s.sample_k else []}]}
    return {"request_id": rid, "model": ctx.model_id, "created": int(time.time()),
            "usage": _usage(L, len(token_ids)), "prompt_logprobs": prompt_lp,
            "prompt_token_id_logprobs": npy_b64(rows.candidates.astype(np.float32)) if rows.candidates is not None
            else None,
            "prompt_token_ids": seq.tolist() if s.p.get("return_token_ids") else None,
            "mm_placeholders": None, "metrics": None, "kv_transfer_params": None, "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None, "token_ids": token_ids,
                         "routed_experts": None, "sampling_mask": None, "logprobs": logprobs}]}


def models(ctx: Ctx) -> dict:
    """GET /v1/models: the one model, with max_model_len."""
    return {"object": "list", "data": [
        {"id": ctx.model_id, "object": "model", "created": ctx.started, "owned_by": "logitserve",
         "root": ctx.model_id, "parent": None, "max_model_len": ctx.loaded.max_seq_len,
         "permission": [{"id": f"modelperm-{ctx.loaded.content_hash[:16]}", "object": "model_permission",
                         "created": ctx.started, "allow_create_engine": False, "allow_sampling": True,
                         "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                         "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}]}]}


TOKENIZE = ParamTable(Param("model", str, "the served model's name"), Param("prompt", str, "the text"),
                      Param("add_special_tokens", bool, "the tokenizer's special tokens (BOS)"),
                      Param("return_token_strs", bool, "each token's vocabulary entry"))


async def tokenize(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /tokenize: {prompt} -> {count, max_model_len, tokens, token_strs}."""
    p = fields(body, TOKENIZE)
    ctx.check_model(p.get("model"))
    if "prompt" not in p:
        raise InvalidRequest("prompt", "a text is needed (chat messages are not templated here)")
    (ids,) = await ctx.tokenize([p["prompt"]], p.get("add_special_tokens", True), client, "prompt")
    strs = None
    if p.get("return_token_strs"):
        strs = ctx.pipeline.text.tokenizer.convert_ids_to_tokens(ids.tolist())
    return {"count": len(ids), "max_model_len": ctx.loaded.max_seq_len, "tokens": ids.tolist(), "token_strs": strs}


def detokenize(ctx: Ctx, body: dict) -> dict:
    """POST /detokenize: {tokens} -> {prompt} (ids outside [0, V) are refused, where vLLM drops them)."""
    ctx.check_model(body.get("model"))
    if ctx.pipeline.text is None:
        raise NotSupported("tokens", "this model directory ships no tokenizer")
    ids = detokenize_ids(body.get("tokens"), "tokens")
    V = ctx.loaded.vocab_size
    bad = np.flatnonzero((ids < 0) | (ids >= V))
    if bad.size:
        raise InvalidRequest(f"tokens[{int(bad[0])}]", f"token id {int(ids[bad[0]])} is outside [0, {V})")
    return {"prompt": ctx.texts.decode(ids)}
