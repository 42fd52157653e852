"""vLLM's POST /generative_scoring: a causal LM as a judge, the probability of label tokens after query + item.

Each item's prompt is query + item (item + query with item_first), the query tokenized with the
special tokens unless add_special_tokens is false, items without (no second BOS), as vLLM builds
them. The engine computes the label tokens' logprobs at the prompt's last position (candidate
logprobs over one row: a placeholder token is appended and only its predicting row reaches the
head, so a query shared by the items is computed once by the scheduler's prefix sharing). The
score is the first label's probability: over the label tokens alone (apply_softmax, vLLM's
default; repeated ids count once) or over the whole vocabulary (apply_softmax false).
Differences, on purpose: a prompt over the model's length is refused, not truncated; temperature
is not read (vLLM ignores it here too).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.spec import Job, ModelKind, OutputKind

from .http_common import Ctx, fields, id_array, is_id_list, new_id
from .params import Param, ParamTable
from .requests import Decoded

GENERATIVE = ParamTable(
    Param("model", str, "the served model's name"),
    Param("apply_softmax", bool, "normalize over the label tokens only (default); false: the model's probability"),
    Param("item_first", bool, "item + query instead of query + item"),
    Param("add_special_tokens", bool, "a text query: the tokenizer's special tokens (BOS)"),
)


@dataclass(frozen=True)
class GenerativePlan:
    """What /generative_scoring decoded, for its encoding."""

    lengths: tuple                        # each prompt's length (without the placeholder)
    softmax: bool                         # apply_softmax


def _in_vocab(ctx: Ctx, ids: np.ndarray, field: str) -> np.ndarray:
    """ids checked against [0, V) here, so that a refusal names the request's own list, not the joined prompt."""
    V = ctx.loaded.vocab_size
    bad = np.flatnonzero((ids < 0) | (ids >= V))
    if bad.size:
        raise InvalidRequest(f"{field}[{bad[0]}]", f"{ids[bad[0]]} is outside the vocabulary [0, {V})")
    return ids


def _labels(ctx: Ctx, value: Any) -> np.ndarray:
    """label_token_ids as int32 [c], each in [0, V), repeats dropped (first kept)."""
    if not isinstance(value, list) or not value or not is_id_list(value):
        raise InvalidRequest("label_token_ids", "a non-empty list of token ids is needed")
    ctx.candidate_lists(value, 1, "label_token_ids")          # the count, as gRPC's candidates
    ids = _in_vocab(ctx, id_array(value, "label_token_ids"), "label_token_ids")
    return np.asarray(list(dict.fromkeys(ids.tolist())), dtype=np.int32)


async def _query(ctx: Ctx, value: Any, special: bool, client: str) -> np.ndarray:
    if isinstance(value, str) and value:
        return (await ctx.tokenize([value], special, client, "query"))[0]
    if is_id_list(value) and value:
        return _in_vocab(ctx, ctx.ids(value, "query"), "query")
    raise InvalidRequest("query", "a text or a non-empty list of token ids is needed")


async def _items(ctx: Ctx, value: Any, client: str) -> tuple:
    if not isinstance(value, list) or not value:
        raise InvalidRequest("items", "a non-empty list of texts or of token-id lists is needed")
    ctx.pipeline.check_rows(len(value), "items")
    if all(isinstance(t, str) for t in value):
        for i, t in enumerate(value):
            if not t:
                raise InvalidRequest(f"items[{i}]", "an empty text; an item must give at least one token")
        return await ctx.tokenize(value, False, client, "items")
    if all(isinstance(t, list) for t in value):
        return tuple(_in_vocab(ctx, x, f"items[{i}]") for i, x in enumerate(ctx.id_lists(value, "items")))
    raise InvalidRequest("items", "all texts or all token-id lists, not a mix")


async def generative_scoring(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /generative_scoring: data[{index, object: "score", score}] per item."""
    async with ctx.pipeline.request(new_id("genscore"), client) as r:
        if ctx.loaded.kind is not ModelKind.CAUSAL_LM:
            raise NotSupported("model", "this server holds a reward model: POST /get_reward, /classify or /score")
        p = fields(body, GENERATIVE)
        ctx.check_model(p.get("model"))
        labels = _labels(ctx, body.get("label_token_ids"))
        query = await _query(ctx, body.get("query"), p.get("add_special_tokens", True), client)
        items = await _items(ctx, body.get("items"), client)
        ctx.pipeline.check_tokens(len(query) * len(items) + sum(len(x) for x in items), "items")
        first = p.get("item_first", False)
        prompts = [np.concatenate([x, query] if first else [query, x]) for x in items]
        # a placeholder after each prompt: its row (the prompt's last position) is the only one read
        seqs = tuple(np.append(x, np.int32(0)).astype(np.int32) for x in prompts)
        plan = GenerativePlan(tuple(len(x) for x in prompts), p.get("apply_softmax", True))
        job = Job(sequences=seqs, candidates=tuple(labels[None] for _ in seqs),
                  prompt_lengths=tuple(len(x) for x in prompts))
        out = await ctx.collect(r, Decoded(job, sequences_field="items"))

    data = []
    for i in range(len(plan.lengths)):
        lp = out.of(OutputKind.CANDIDATE_LOGPROBS, i)[0].astype(np.float64)   # [c] log p(label | prompt)
        if plan.softmax:
            e = np.exp(lp - lp.max())
            score = e[0] / e.sum()
        else:
            score = np.exp(lp[0])
        data.append({"index": i, "object": "score", "score": float(score)})
    n = int(sum(plan.lengths))
    return {"id": new_id("generative-scoring"), "object": "list", "created": int(time.time()), "model": ctx.model_id,
            "data": data, "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}
