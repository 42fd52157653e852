"""Reward routes as RL frameworks call them: OpenRLHF's and slime's /get_reward, SGLang's /v1/embeddings, vLLM's /score.

- POST /get_reward, OpenRLHF (`--remote_rm_url`): {"query": [text], "prompts", "labels"} (or
  {"messages": [conversation]}) -> {"rewards": [r], "scores": [r], "extra_logs": {}}; empty lists
  (OpenRLHF slices a batch over all its URLs, so all but the first may get none) -> empty lists.
- POST /get_reward, slime (`--rm-type remote_rm --rm-url`): {"prompt", "response", "label"} -> the
  reward as a bare JSON number; the prompt is templated text (prompt + response is scored) or a list
  of messages (the response is appended as the assistant's turn and the chat template renders it).
- POST /v1/embeddings (verl's reward loop with an SGLang backend): each input's raw scores as its
  embedding (verl reads data[-1].embedding[-1]).
- POST /score and /v1/score (vLLM): text_1 x text_2 pairs -> data[{index, object: "score", score}].
A reward is the score of the model's last label (its only one for a scalar reward model), as verl
reads probs[-1]; raw, as OpenRLHF's own server returns it. On a process reward model (a token
classifier) /get_reward's reward is the last step's score and the step scores go to extra_logs
(server/reward_steps.py); the other routes score its last token. Texts are tokenized by the rules of
server/reward_text.py. Every score comes from the engine (one Job of scores); no math here.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Awaitable, Callable

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported
from logitserve.spec import Job, ModelKind, OutputKind

from .http_common import Ctx, b64_array, fields, is_id_list, new_id
from . import reward_steps
from .params import Param, ParamTable
from .requests import Decoded
from .reward_text import conversations, text_list, tokenize_chat, tokenize_templated
from .trl_api import activated, use_activation

REWARD = ParamTable(
    Param("add_special_tokens", bool, "texts: add the tokenizer's special tokens; absent: unless a text begins with "
                                      "the BOS token"),
)
EMBEDDINGS = ParamTable(
    Param("model", str, "the served model's name"),
    Param("encoding_format", str, "float or base64 (little-endian float32)", choices=("float", "base64")),
    Param("add_special_tokens", bool, "texts: the tokenizer's special tokens (BOS), as SGLang adds them"),
)
SCORE = ParamTable(
    Param("model", str, "the served model's name"),
    Param("use_activation", bool, "sigmoid (softmax for several labels) of the score; false: raw"),
    Param("activation", bool, "older vLLM's name of use_activation"),
    Param("softmax", bool, "older vLLM's name of use_activation"),
)

Prepare = Callable[[], Awaitable[tuple]]


def _need_reward(ctx: Ctx, where: str) -> None:
    if ctx.loaded.kind not in (ModelKind.REWARD, ModelKind.TOKEN_REWARD):
        raise NotSupported(where, "this server holds a causal LM, not a reward model: POST /generative_scoring for "
                                  "label-token probabilities, or /v1/completions")


async def scores(ctx: Ctx, client: str, where: str, prepare: Prepare) -> tuple[tuple, np.ndarray]:
    """(ids per input, raw scores [B, num_labels] fp32) from the engine; `prepare` makes the ids inside the
    request pipeline (admitted, logged, its errors mapped there)."""
    async with ctx.pipeline.request(new_id("reward"), client) as r:
        _need_reward(ctx, where)
        seqs = await prepare()
        out = await ctx.collect(r, Decoded(Job(sequences=seqs, scores=True), sequences_field=where))
    return seqs, np.stack([out.of(OutputKind.SCORES, i) for i in range(len(seqs))])


def _rewards(raw: np.ndarray) -> list[float]:
    """The last label's raw score of each input, as Python floats (their exact float32 values)."""
    return raw[:, -1].astype(np.float64).tolist()


async def rewards(ctx: Ctx, client: str, where: str, prepare: Prepare, body: dict) -> tuple[list[float], dict]:
    """(each input's reward, OpenRLHF's extra_logs): a sequence classifier's last-label score; a process reward
    model's last step's (server/reward_steps.py), its step scores in extra_logs."""
    if ctx.loaded.kind is not ModelKind.TOKEN_REWARD:
        return _rewards((await scores(ctx, client, where, prepare))[1]), {}
    async with ctx.pipeline.request(new_id("reward"), client) as r:
        steps = reward_steps.separators(ctx, body)
        seqs = await prepare()
        reward_steps.check_steps(steps, seqs, where)
        out = await ctx.collect(r, Decoded(Job(sequences=seqs, step_scores=steps), sequences_field=where))
    values, per_step = reward_steps.step_rewards(out, len(seqs))
    return values, reward_steps.extra_logs(per_step)


async def get_reward(ctx: Ctx, body: dict, client: str):
    """POST /get_reward: OpenRLHF's batch, or slime's single sample (a body with `response` and no `query`)."""
    _need_reward(ctx, "query")
    if "query" not in body and "messages" not in body and "response" in body:
        return await _slime(ctx, body, client)
    p = fields(body, REWARD)
    query, messages = body.get("query"), body.get("messages")
    if (query is None) == (messages is None):
        raise InvalidRequest("query", "set exactly one of query (OpenRLHF: a list of texts) and messages (a list of "
                                      "conversations); slime sends prompt and response")
    if query == [] or messages == []:
        return {"rewards": [], "scores": [], "extra_logs": {}}
    if messages is not None:
        convs = conversations(ctx, messages, "messages")
        prepare = partial(tokenize_chat, ctx, convs, client, "messages")
    else:
        prepare = partial(tokenize_templated, ctx, text_list(query, "query"), client, "query",
                          p.get("add_special_tokens"))
    values, logs = await rewards(ctx, client, "messages" if messages is not None else "query", prepare, body)
    return {"rewards": values, "scores": values, "extra_logs": logs}


async def _slime(ctx: Ctx, body: dict, client: str) -> float:
    """slime's remote_rm sample: the reward of prompt + response, as a bare number."""
    prompt, response = body.get("prompt"), body.get("response")
    if not isinstance(response, str):
        raise InvalidRequest("response", f"slime's sample: the response text is needed, got {type(response).__name__}")
    if isinstance(prompt, list):
        conv = conversations(ctx, prompt, "prompt")
        if len(conv) != 1:
            raise InvalidRequest("prompt", "one conversation (a list of messages) is needed")
        convs = [conv[0] + [{"role": "assistant", "content": response}]]
        prepare = partial(tokenize_chat, ctx, convs, client, "prompt")
    elif isinstance(prompt, str):
        prepare = partial(tokenize_templated, ctx, text_list(prompt + response, "prompt"), client, "prompt")
    else:
        raise InvalidRequest("prompt", f"slime's sample: a text or a list of messages is needed, got "
                                       f"{type(prompt).__name__}")
    return (await rewards(ctx, client, "prompt", prepare, body))[0][0]


async def texts_or_ids(ctx: Ctx, value: Any, client: str, where: str, special) -> tuple:
    """ids of a text, a list of texts, a list of ids or a list of id lists."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
        return await tokenize_templated(ctx, text_list(value, where), client, where, special)
    if is_id_list(value) and value:
        return (ctx.ids(value, where),)
    if isinstance(value, list) and value:
        return ctx.id_lists(value, where)
    raise InvalidRequest(where, "a text, token ids, or a non-empty list of either is needed")


def _usage(seqs) -> dict:
    n = int(sum(len(x) for x in seqs))
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0, "prompt_tokens_details": None}


async def embeddings(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /v1/embeddings on a reward model: each input's raw scores as its embedding (SGLang's answer)."""
    p = fields(body, EMBEDDINGS)
    ctx.check_model(p.get("model"))
    if body.get("messages") is not None:
        where = "messages"
        prepare = partial(tokenize_chat, ctx, conversations(ctx, body["messages"], where), client, where)
    else:
        where = "input"
        prepare = partial(texts_or_ids, ctx, body.get("input"), client, where, p.get("add_special_tokens", True))
    seqs, raw = await scores(ctx, client, where, prepare)
    b64 = p.get("encoding_format") == "base64"
    data = [{"object": "embedding", "index": i,
             "embedding": b64_array(v.astype("<f4")) if b64 else v.astype(np.float64).tolist()}
            for i, v in enumerate(raw)]
    return {"id": new_id("embd"), "object": "list", "created": int(time.time()), "model": ctx.model_id,
            "data": data, "usage": _usage(seqs)}


def _pairs(body: dict) -> tuple[list[str], list[str]]:
    """vLLM's text_1 x text_2: one against many, or many against as many (pairwise)."""
    t1, t2 = text_list(body.get("text_1"), "text_1"), text_list(body.get("text_2"), "text_2")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    if len(t1) != len(t2):
        raise InvalidRequest("text_2", f"{len(t2)} texts for {len(t1)} in text_1: one text_1, or one per text_2")
    return t1, t2


async def score(ctx: Ctx, body: dict, client: str) -> dict:
    """POST /score (/v1/score): each (text_1, text_2) pair's score: text_1's ids (BOS rule) then text_2's, no
    special tokens between."""
    p = fields(body, SCORE)
    ctx.check_model(p.get("model"))
    if body.get("truncate_prompt_tokens") not in (None, -1):
        raise NotSupported("truncate_prompt_tokens", "this server never truncates; send shorter texts")
    t1, t2 = _pairs(body)

    async def prepare() -> tuple:
        a = await tokenize_templated(ctx, t1, client, "text_1")
        b = await tokenize_templated(ctx, t2, client, "text_2", special=False)
        return tuple(np.concatenate([x, y]) for x, y in zip(a, b))

    seqs, raw = await scores(ctx, client, "text_1", prepare)
    values = activated(raw) if use_activation(p) else raw.astype(np.float64)
    return {"id": new_id("score"), "object": "list", "created": int(time.time()), "model": ctx.model_id,
            "data": [{"index": i, "object": "score", "score": float(v[-1])} for i, v in enumerate(values)],
            "usage": _usage(seqs)}
