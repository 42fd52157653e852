"""The fields each HTTP route honours: any other top-level field is refused 400 naming it, never dropped silently.

vLLM's request models carry many fields this server does not act on (`truncate_prompt_tokens`, `priority`,
`mm_processor_kwargs`, `chat_template_kwargs`, ...); vLLM itself also ignores unknown ones with a warning in
its log. A caller relying on one would get other numbers with no error, so every route here names what it
honours, and a field outside that set is refused unless it is null or its value asks for nothing
(http_common.INERT). The same holds inside `sampling_params` (http_common.fields, strict).
The tables are the fields each handler reads (server/openai_api.py, sglang_api.py, trl_api.py,
reward_api.py, generative_scoring.py): tests/test_http_fields.py sends each handler's fields and each field of
vLLM's request models that is missing here. No math here.
"""
from __future__ import annotations

from typing import Any

from logitserve.errors import InvalidRequest

from . import generative_scoring, openai_api, reward_api, sglang_api, trl_api
from .http_common import is_inert
from .reward_steps import FIELD as STEP_SEPARATOR_IDS


def _names(*tables, extra: tuple[str, ...] = ()) -> frozenset[str]:
    return frozenset(name for t in tables for name in t.params) | frozenset(extra)


_CLASSIFY_VLLM = _names(trl_api.CLASSIFY, extra=("input", "messages"))
_CLASSIFY_SGLANG = frozenset({"model", "text", "input_ids"})

# route -> the top-level fields its handler reads
ACCEPTED: dict[str, frozenset[str]] = {
    "/v1/completions": _names(openai_api.COMPLETIONS, extra=("prompt",)),
    "/inference/v1/generate": _names(openai_api.GENERATE, extra=("sampling_params", "token_ids")),
    "/tokenize": _names(openai_api.TOKENIZE),
    "/detokenize": frozenset({"model", "tokens"}),
    "/generate": _names(sglang_api.GENERATE, extra=("input_ids", "text", "sampling_params", "token_ids_logprob")),
    "/get_sequence_logprobs/": _names(trl_api.SEQUENCE_LOGPROBS, extra=("sequences", "prompt_lengths")),
    "/classify": _CLASSIFY_VLLM | _CLASSIFY_SGLANG,
    "/pooling": _CLASSIFY_VLLM,
    # OpenRLHF's remote RM sends prompts and labels beside query, slime's its sample's label: context and ground
    # truth for rule-based rewards, which no learned reward model reads (query / prompt + response hold the text)
    "/get_reward": _names(reward_api.REWARD, extra=("query", "messages", "prompt", "response", "label", "prompts",
                                                    "labels", STEP_SEPARATOR_IDS)),
    "/v1/embeddings": _names(reward_api.EMBEDDINGS, extra=("input", "messages")),
    "/score": _names(reward_api.SCORE, extra=("text_1", "text_2")),
    "/generative_scoring": _names(generative_scoring.GENERATIVE, extra=("query", "items", "label_token_ids")),
}
ACCEPTED["/v1/score"] = ACCEPTED["/score"]

def check_fields(route: str, body: dict) -> None:
    """InvalidRequest naming the first field of `body` that `route` does not honour (null values are absent)."""
    accepted = ACCEPTED.get(route)
    if accepted is None:
        return
    for name, value in body.items():
        if name in accepted or value is None or is_inert(name, value):
            continue
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise InvalidRequest(shown, f"not honoured by this server on {route} (refused rather than ignored: the "
                                    f"answer would not be what it asks); fields accepted: {', '.join(sorted(accepted))}")
