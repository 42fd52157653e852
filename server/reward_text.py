"""Texts of the reward routes: chat messages rendered with the model's own template, and templated text tokenized once.

RL frameworks send a reward model text that already went through a chat template (OpenRLHF decodes
prompt + response with the special tokens kept; slime sends the templated prompt and the response)
or the conversation itself (OpenAI `messages`). Rules, one for each:
- `messages` are rendered server-side with the tokenizer's own `chat_template`
  (transformers `apply_chat_template`, no generation prompt) and tokenized without adding special
  tokens, as `apply_chat_template(tokenize=True)` does: the template places them.
- A text is tokenized with the tokenizer's special tokens unless it already begins with the BOS
  token's text, so a templated text never gets a second BOS (OpenRLHF's own `serve_rm.py` never adds
  them; a bare text still gets the BOS its model was trained with).
No math here.
"""
from __future__ import annotations

import asyncio
from typing import Any, Optional

import numpy as np

from logitserve.errors import InvalidRequest, NotSupported, TooLarge

from .http_common import Ctx

ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(m: Any, where: str) -> dict:
    """One OpenAI chat message as {role, content}; content parts may only be text."""
    if not isinstance(m, dict):
        raise InvalidRequest(where, f"a message object {{role, content}} is needed, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role", f"{str(role)[:32]!r} is not a chat role; one of {', '.join(ROLES)}")
    content = m.get("content")
    if isinstance(content, list):          # OpenAI content parts: [{"type": "text", "text": ...}]
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}.content[{k}]", "only text parts {type: text, text} are accepted")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise InvalidRequest(f"{where}.content", f"a string (or text parts) is needed, got {type(content).__name__}")
    return {"role": role, "content": content}


def conversations(value: Any, field: str) -> list[list[dict]]:
    """`messages` as a list of conversations: one conversation (a list of messages) or a non-empty list of them."""
    if not isinstance(value, list) or not value:
        raise InvalidRequest(field, "a list of {role, content} messages, or a non-empty list of such lists, is needed")
    batched = isinstance(value[0], list)
    convs = value if batched else [value]
    out = []
    for i, conv in enumerate(convs):
        where = f"{field}[{i}]" if batched else field
        if not isinstance(conv, list) or not conv:
            raise InvalidRequest(where, "a non-empty list of {role, content} messages is needed")
        out.append([_message(m, f"{where}[{j}]") for j, m in enumerate(conv)])
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


def _render(tok, convs: list[list[dict]], field: str) -> list[str]:
    out = []
    for i, conv in enumerate(convs):
        try:
            out.append(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=False))
        except Exception as e:     # noqa: BLE001 (a template's own refusal, e.g. roles that must alternate)
            raise InvalidRequest(f"{field}[{i}]" if len(convs) > 1 else field,
                                 f"the model's chat template refused it: {str(e)[:200]}") from None
    return out


async def render_chat(ctx: Ctx, convs: list[list[dict]], field: str) -> list[str]:
    """Each conversation as the text the model's chat template makes of it (on a worker thread)."""
    tok = _tokenizer(ctx, field)
    if not getattr(tok, "chat_template", None):
        raise InvalidRequest(field, "this model's tokenizer has no chat template (tokenizer_config.json "
                                    "chat_template); send the templated text instead")
    _check_bytes(ctx, [m["content"] for conv in convs for m in conv], field)
    return await asyncio.to_thread(_render, tok, convs, field)


async def tokenize_chat(ctx: Ctx, convs: list[list[dict]], client: str, field: str) -> tuple[np.ndarray, ...]:
    """Rendered conversations as ids, the template's own special tokens only."""
    return await ctx.tokenize(await render_chat(ctx, convs, field), False, client, field)


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
