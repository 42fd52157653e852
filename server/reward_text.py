"""Texts of the reward routes: chat messages rendered with the model's own template, and templated text tokenized once.

RL frameworks send a reward model text that already went through a chat template (OpenRLHF decodes
prompt + response with the special tokens kept; slime sends the templated prompt and the response)
or the conversation itself (OpenAI `messages`). Rules, one for each:
- `messages` are rendered server-side with the tokenizer's own `chat_template`
  (transformers `apply_chat_template`, no generation prompt) and tokenized without adding special
  tokens, as `apply_chat_template(tokenize=True)` does: the template places them. Each message reaches
  the template as vLLM hands it over: text parts joined with "\n", null content as "", `name`,
  `tool_call_id` and `tool_calls` (their JSON arguments parsed) kept. Their declared sizes are bounded
  before anything is walked or rendered, and rendering runs inside the request's admission and budget.
- A text is tokenized with the tokenizer's special tokens unless it already begins with the BOS
  token's text, so a templated text never gets a second BOS (OpenRLHF's own `serve_rm.py` never adds
  them; a bare text still gets the BOS its model was trained with).
No math here.
"""
from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported, TooLarge

from .http_common import Ctx

ROLES = ("system", "developer", "user", "assistant", "tool")
# What a chat template adds to a rendered conversation per message (and per content part) at the least, counted with
# the contents' characters against --max-text-bytes before anything is walked, rendered or tokenized: a million
# empty messages are refused on their count, not after seconds of rendering.
MESSAGE_BYTES = 16
# Bytes of memory rendering holds per byte of conversation (the template's strings, the conversation's dicts).
RENDER_BYTES_PER_BYTE = 16


class _Budget:
    """The declared size of a request's conversations, bounded as they are walked: TooLarge naming the bound."""

    def __init__(self, ctx: Ctx, field: str):
        self.limits, self.field, self.used = ctx.pipeline.stream_limits, field, 0

    def add(self, nbytes: int, what: str) -> None:
        self.used += nbytes
        limit = self.limits.max_text_bytes
        if self.used > limit:
            raise TooLarge(f"{self.field}: {what} make over {limit} bytes of conversation (each message and content "
                           f"part counted as at least {MESSAGE_BYTES} bytes, with its text) over the server's "
                           f"--max-text-bytes {limit}; send fewer or shorter conversations per request")

    def conversations(self, n: int) -> None:
        limit = self.limits.max_sequences
        if n > limit:
            raise TooLarge(f"{self.field}: {n} conversations is over the server's --max-sequences-per-request {limit}")


def _content(content: Any, where: str, budget: _Budget) -> str:
    """A message's content as vLLM renders it: a string; text parts joined with "\n"; null as ""."""
    if content is None:                    # vLLM: no content (an assistant turn of tool calls, say) is ""
        return ""
    if isinstance(content, str):
        budget.add(len(content), f"{where}.content")
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content", f"a string (or text parts) is needed, got {type(content).__name__}")
    budget.add(MESSAGE_BYTES * len(content), f"{len(content)} content parts at {where}")
    texts = []
    for k, part in enumerate(content):     # OpenAI content parts: [{"type": "text", "text": ...}]
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"{where}.content[{k}]", "only text parts {type: text, text} are accepted")
        budget.add(len(part["text"]), f"{where}.content[{k}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls: Any, where: str, budget: _Budget) -> list:
    """An assistant turn's tool_calls as vLLM hands them to the template: each function's JSON `arguments` string
    parsed to an object (templates iterate them)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"{where}.tool_calls", f"a list of tool calls is needed, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"{where}.tool_calls[{k}]", "a {type: function, function: {name, arguments}} "
                                                              "object is needed")
        arguments = function.get("arguments")
        budget.add(MESSAGE_BYTES + len(function["name"]) + len(str(arguments or "")), f"{where}.tool_calls[{k}]")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise InvalidRequest(f"{where}.tool_calls[{k}].function.arguments", "not valid JSON") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _message(m: Any, where: str, budget: _Budget) -> dict:
    """One OpenAI chat message as vLLM gives it to the chat template: role, content (a string), and where present
    its name, an assistant's tool_calls, a tool's tool_call_id."""
    if not isinstance(m, dict):
        raise InvalidRequest(where, f"a message object {{role, content}} is needed, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role", f"{str(role)[:32]!r} is not a chat role; one of {', '.join(ROLES)}")
    out = {"role": role, "content": _content(m.get("content"), where, budget)}
    for key in ("name", "tool_call_id"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidRequest(f"{where}.{key}", f"a string is needed, got {type(value).__name__}")
            budget.add(len(value), f"{where}.{key}")
            out[key] = value
    if m.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(m["tool_calls"], where, budget)
    return out


def conversations(ctx: Ctx, value: Any, field: str) -> list[list[dict]]:
    """`messages` as a list of conversations: one conversation (a list of messages) or a non-empty list of them. Their
    declared sizes (conversations, messages, parts, characters) are bounded before each is walked (_Budget)."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest(field, "a list of {role, content} messages, or a non-empty list of such lists, is needed")
    batched = isinstance(value[0], list)
    convs = value if batched else [value]
    budget = _Budget(ctx, field)
    budget.conversations(len(convs))
    budget.add(MESSAGE_BYTES * sum(len(c) if isinstance(c, list) else 1 for c in convs),
               f"{sum(len(c) if isinstance(c, list) else 1 for c in convs)} messages")
    out = []
    for i, conv in enumerate(convs):
        where = f"{field}[{i}]" if batched else field
        if not isinstance(conv, list) or not conv:
            raise InvalidRequest(where, "a non-empty list of {role, content} messages is needed")
        out.append([_message(m, f"{where}[{j}]", budget) for j, m in enumerate(conv)])
    return out


def _tokenizer(ctx: Ctx, field: str):
    text = ctx.pipeline.text
    if text is None:
        raise NotSupported(field, "this model directory ships no tokenizer; send token ids")
    return text.tokenizer


def _check_bytes(ctx: Ctx, texts: list[str], field: str) -> None:
    """--max-text-bytes over all of a request's texts, before anything is rendered or tokenized."""
    size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
    limit = ctx.pipeline.stream_limits.max_text_bytes
    if size > limit:
        raise TooLarge(f"{field}: {size} UTF-8 bytes in this request is over the server's --max-text-bytes {limit}; "
                       f"send fewer or shorter texts per request, or token ids")


def _size(convs: list[list[dict]]) -> int:
    """UTF-8 bytes of the conversations' texts, with MESSAGE_BYTES per message."""
    return sum(MESSAGE_BYTES + len(m["content"].encode("utf-8", "surrogatepass")) for conv in convs for m in conv)


def _render(tok, convs: list[list[dict]], field: str) -> list[str]:
    out = []
    for i, conv in enumerate(convs):
        try:
            out.append(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False))
        except Exception as e:     # noqa: BLE001 (a template's own refusal, e.g. roles that must alternate)
            raise InvalidRequest(f"{field}[{i}]" if len(convs) > 1 else field,
                                 f"the model's chat template refused it: {str(e)[:200]}") from None
    return out


async def render_chat(ctx: Ctx, convs: list[list[dict]], client: str, field: str) -> list[str]:
    """Each conversation as the text the model's chat template makes of it: on a worker thread, its memory held in
    the budget as tokenizing's (call it inside the request pipeline, after admission)."""
    tok = _tokenizer(ctx, field)
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest(field, "this model's tokenizer has no chat template (tokenizer_config.json "
                                    "chat_template); send the templated text instead")
    size = _size(convs)
    _check_bytes(ctx, [m["content"] for conv in convs for m in conv], field)
    with ctx.pipeline.scheduler.holding(client, size * RENDER_BYTES_PER_BYTE, f"rendering {size} bytes of chat"):
        return await asyncio.to_thread(_render, tok, convs, field)


async def tokenize_chat(ctx: Ctx, convs: list[list[dict]], client: str, field: str) -> tuple[np.ndarray, ...]:
    """Rendered conversations as ids, the template's own special tokens only."""
    return await ctx.tokenize(await render_chat(ctx, convs, client, field), False, client, field)


def text_list(value: Any, field: str, allow_empty: bool = False) -> list[str]:
    """A text or a list of texts, each non-empty."""
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or (not texts and not allow_empty) or not all(isinstance(t, str) for t in texts):
        raise InvalidRequest(field, "a text or a list of texts is needed")
    for i, t in enumerate(texts):
        if not t:
            raise InvalidRequest(f"{field}[{i}]", "an empty text; a text must give at least one token")
    return texts


async def tokenize_templated(ctx: Ctx, texts: list[str], client: str, field: str,
                             special: Optional[bool] = None) -> tuple[np.ndarray, ...]:
    """Texts as ids: with the special tokens when `special`, without when not; None: the BOS rule (special
    tokens only for a text that does not already begin with the BOS token's text)."""
    ctx.pipeline.check_rows(len(texts), field)
    _check_bytes(ctx, texts, field)
    if special is not None:
        return await ctx.tokenize(texts, special, client, field)
    bos = getattr(_tokenizer(ctx, field), "bos_token", None)
    add = [not (bos and t.startswith(bos)) for t in texts]
    out: list = [None] * len(texts)
    for flag in (True, False):
        idx = [i for i, a in enumerate(add) if a is flag]
        if idx:
            for i, ids in zip(idx, await ctx.tokenize([texts[i] for i in idx], flag, client, field)):
                out[i] = ids
    return tuple(out)
