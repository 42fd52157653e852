"""What every HTTP front-end shares: typed JSON fields, prompts and token-id lists, a job's arrays, token texts.

The vLLM, SGLang and TRL shapes (server/openai_api.py, sglang_api.py, trl_api.py) each read a
request as `async with ctx.pipeline.request(...) as r` (the shared request pipeline: admission,
limits, validation, scheduling, status), decode the JSON body into a plan and a Job with these
helpers, collect its pieces with `Ctx.collect` and encode the arrays. No math here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import orjson

from logitserve.errors import InvalidRequest, NotFound, TooLarge
from logitserve.tokenizing import check_detokenize_count
from logitserve.validate import check_candidates_per_row

from .codec import check_name, shown_id
from .http_answer import check_json_entries, hold_for_answer
from .params import ParamTable
from .dense import Dense
from .requests import Decoded, Pipeline, Request


_ANY = object()
# Fields accepted beside a route's own (server/http_fields.py) or a table's (`fields(strict=True)`) only with a value
# that asks for nothing this server would do otherwise: name -> those values; any other value is refused naming it.
INERT: dict[str, tuple] = {
    "user": (_ANY,),                          # OpenAI's end-user id: informational
    "request_id": (_ANY,),                    # vLLM's: names the request only
    "priority": (0,),                         # vLLM's scheduling priority (this server has client fairness)
    "truncate_prompt_tokens": (-1,),          # -1: the model's length; longer prompts are refused here
    "stream": (False,),
    "echo": (False,),
    "n": (1,),
    "add_generation_prompt": (False,),        # a scored conversation ends with its last turn
    "continue_final_message": (False,),
    # sampling knobs at their no-op values (nothing is sampled here: logprobs of given tokens, the greedy token)
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "repetition_penalty": (1,),
    "frequency_penalty": (0,), "presence_penalty": (0,),
    # SGLang's (slime sends false); sglang-router sends true, vLLM's default: which special tokens its generated
    # text keeps, where a prompt's logprobs have none
    "skip_special_tokens": (False, True),
    # sglang-router adds these to every /v1/completions it forwards, at their defaults: no stop string is taken
    # here (so none is trimmed), generation ends at max_tokens or EOS as asked, no hidden states come back
    "no_stop_trim": (False, True), "ignore_eos": (False,), "return_hidden_states": (False,),
}


def is_inert(name: str, value: Any) -> bool:
    """Whether `value` of a field this server does not act on asks for nothing (INERT)."""
    return any(a is _ANY or (a == value and isinstance(a, bool) == isinstance(value, bool))
               for a in INERT.get(name, ()))


def fields(body: dict, table: ParamTable, where: str = "", strict: bool = False, also: tuple = ()) -> dict[str, Any]:
    """The table's fields of a JSON body, typed (null = absent); fields not in the table are left to the caller,
    or with `strict` refused naming the first (unless INERT or in `also`, those the caller reads itself)."""
    present = {k: v for k, v in body.items() if v is not None and (
        k in table.params or (strict and k not in also and not is_inert(k, v)))}
    return table.read(present, where)


def json_values_bound(limits) -> int:
    """The most JSON values (commas) a body may hold: what a request within --max-request-tokens and
    --max-text-bytes (a comma in a text counts too) and --max-sequences-per-request holds, twice over."""
    return 2 * (limits.max_request_tokens + limits.max_text_bytes + 16 * limits.max_sequences)


def json_object(raw: bytes, where: str = "body", max_values: Optional[int] = None) -> dict:
    """A request body as a JSON object, or InvalidRequest saying why not. With `max_values`, a body holding more
    values than that (counted as its commas, at memory speed, before anything is parsed) is TooLarge: parsing
    and freeing a body costs the event loop time in proportion to its values, so none costs more than a request
    within the limits can."""
    if max_values is not None and (n := raw.count(b",")) > max_values:
        raise TooLarge(f"{where}: {n} JSON values (commas) is over the {max_values} a request within the server's "
                       f"--max-request-tokens, --max-text-bytes and --max-sequences-per-request can hold")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidRequest(where, f"not valid JSON ({str(e)[:120]})") from None
    if not isinstance(body, dict):
        raise InvalidRequest(where, f"a JSON object is needed, got {type(body).__name__}")
    return body


def id_array(value: Any, field: str) -> np.ndarray:
    """One list of token ids as int32 [L]; whole-number floats are accepted, anything else names the element."""
    if not isinstance(value, list):
        raise InvalidRequest(field, f"a list of token ids is needed, got {type(value).__name__}")
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError):
        arr = np.asarray(value, dtype=object)
    if arr.ndim != 1 or arr.dtype.kind not in "iuf" or any(type(x) is bool for x in value):   # numpy casts True
        bad = next((j for j, x in enumerate(value) if isinstance(x, bool) or not isinstance(x, (int, float))), 0)
        raise InvalidRequest(f"{field}[{bad}]", f"{str(value[bad])[:32]!r} is not a token id (an integer)")
    if arr.dtype.kind == "f":
        whole = np.isfinite(arr) & (arr == np.round(arr))
        if not whole.all():
            bad = int(np.flatnonzero(~whole)[0])
            raise InvalidRequest(f"{field}[{bad}]", f"{value[bad]!r} is not a whole number")
    if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
        bad = int(np.flatnonzero((arr < np.iinfo(np.int32).min) | (arr > np.iinfo(np.int32).max))[0])
        raise InvalidRequest(f"{field}[{bad}]", f"token id {value[bad]} does not fit int32 (ids are < V)")
    return arr.astype(np.int32)


def is_id_list(value: Any) -> bool:
    """One list of ids (not a list of lists, not a list of strings)."""
    return isinstance(value, list) and (not value or not isinstance(value[0], (list, str)))


@dataclass(frozen=True)
class Prompts:
    """What a field holding "a text, a list of ids, or a list of either" held, as token ids."""

    seqs: tuple[np.ndarray, ...]          # int32 [L] per prompt
    texts: Optional[list[str]]            # the prompts as sent, when texts (the server tokenized them)
    batched: bool                         # a list of prompts, not one text or one list of ids


class TokenTexts:
    """Each id decoded alone as vLLM shows it (decode([id]), its SentencePiece leading space kept), cached."""

    def __init__(self, text):
        self._tok = text.tokenizer if text is not None else None
        self._cache: dict[int, str] = {}

    @property
    def available(self) -> bool:
        return self._tok is not None

    def of(self, ids) -> list[str]:
        ids = [int(x) for x in ids]
        if self._tok is None:
            return [None] * len(ids)
        missing = sorted({x for x in ids if x not in self._cache})
        if missing:
            raw = self._tok.convert_ids_to_tokens(missing)
            for x, r in zip(missing, raw):
                text = self._tok.decode([x]) or ""
                if isinstance(r, str) and r.startswith("\u2581") and not text.startswith(" "):
                    text = " " + text
                self._cache[x] = text
        return [self._cache[x] for x in ids]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if self._tok is None:
            return ""
        return self._tok.decode([int(x) for x in ids], skip_special_tokens=skip_special_tokens)


@dataclass
class Ctx:
    """One server's HTTP side: the pipeline, the model and its names, and what the shapes need to encode."""

    pipeline: Pipeline
    loaded: Any                       # loading.LoadedModel
    names: tuple[str, ...]            # served model names: the first is the id, the others aliases
    version: str
    max_response_bytes: int
    texts: TokenTexts
    tables: Any = None                # json_logprobs.VocabTables over the model's vocabulary
    encoder: Any = None               # encode_process.EncodeProcess: bulk prompt logprobs, off the GIL
    started: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        from .encode_process import EncodeProcess
        from .json_logprobs import VocabTables

        if self.tables is None:
            self.tables = VocabTables(self.texts, self.loaded.vocab_size)
        if self.encoder is None:
            self.encoder = EncodeProcess(self.tables)

    @property
    def model_id(self) -> str:
        return self.names[0]

    def check_model(self, name: Any, where: str = "model") -> None:
        """An absent or empty model name means the one served here; another name is NOT_FOUND; one over the
        bound of gRPC's names (codec.MAX_REQUEST_ID bytes) INVALID_ARGUMENT."""
        if name is None or name == "" or name in self.names:
            return
        if not isinstance(name, str):
            raise InvalidRequest(where, f"a string is needed, got {type(name).__name__}")
        check_name(name, where)
        raise NotFound(where, f"the model `{name[:128]}` does not exist; this server holds {self.model_id!r}")

    def ids(self, value: Any, field: str) -> np.ndarray:
        """One list of token ids as int32 [L], its length checked against --max-request-tokens before it is
        converted."""
        if isinstance(value, list):
            self.pipeline.check_tokens(len(value), field)
        return id_array(value, field)

    def id_lists(self, values: list, field: str) -> tuple[np.ndarray, ...]:
        """A batch of token-id lists as int32 arrays; their count (--max-sequences-per-request) and total length
        (--max-request-tokens) are checked before any of them is converted."""
        self.pipeline.check_rows(len(values), field)
        self.pipeline.check_tokens(sum(len(x) for x in values if isinstance(x, list)), field)
        return tuple(id_array(x, f"{field}[{i}]") for i, x in enumerate(values))

    def candidate_lists(self, value: Any, n: int, field: str) -> list:
        """One list of candidate ids per input (one list given: the same for all), unconverted, each at most V
        long (validate.check_candidates_per_row, as gRPC's)."""
        if not isinstance(value, list) or not value:
            raise InvalidRequest(field, "a list of token ids, or one per input, is needed")
        per = value if isinstance(value[0], list) else [value] * n
        if len(per) != n or not all(isinstance(c, list) for c in per) or len({len(c) for c in per}) != 1:
            raise InvalidRequest(field, "one list of ids (the same length) for every input")
        check_candidates_per_row(field, len(per[0]), self.loaded.vocab_size)
        return per

    def check_json_size(self, entries: int, where: str, streamed: bool = False) -> None:
        """Refuse (TooLarge) a JSON answer of `entries` logprob entries over --max-response-bytes, called on the
        counts a request declares before anything is expanded; and hold what building it takes in the memory
        budget until it is sent (server/http_answer.py)."""
        check_json_entries(entries, where, self.max_response_bytes, streamed)

    async def tokenize(self, texts: list[str], special: bool, client: str, where: str) -> tuple:
        return await self.pipeline.tokenize(texts, special, client, where)

    async def prompts(self, value: Any, field: str, client: str, need: str, special: bool = True,
                      texts: bool = True, ids: bool = True) -> Prompts:
        """A text, a list of texts, a list of ids or a list of id lists (those of them the route takes: `texts`,
        `ids`), as token ids; their count and size checked before anything is tokenized or converted. `need`:
        the route's message for a value that is none of them (an empty one included)."""
        one = texts and isinstance(value, str)
        items = [value] if one else value
        if not isinstance(items, list) or not items:
            raise InvalidRequest(field, need)
        if texts and all(isinstance(x, str) for x in items):
            self.pipeline.check_rows(len(items), field)
            prompts = Prompts(await self.pipeline.tokenize(items, special, client, field), items, not one)
        elif ids and is_id_list(items):
            prompts = Prompts((self.ids(items, field),), None, False)
        elif ids:
            prompts = Prompts(self.id_lists(items, field), None, True)
        else:
            raise InvalidRequest(field, need)
        return prompts

    async def collect(self, r: Request, decoded: Decoded) -> Dense:
        """Run `decoded` as request `r`, its pieces into per-sequence arrays, held in the memory budget with the
        answer (server/http_answer.py) unless over --max-response-bytes (the pipeline refuses that next)."""
        cost = self.pipeline.scheduler.cost(decoded.job)
        if cost is not None and cost.output_bytes <= self.max_response_bytes:
            hold_for_answer(cost.output_bytes, "the answer's arrays")
        return await Dense.collect(r.run(decoded), len(decoded.job.sequences))


def request_id(body: dict, field: str, prefix: str) -> str:
    """The id a request is logged under: the client's `field` (its first MAX_REQUEST_ID bytes: check_request_id
    refuses a longer one inside the pipeline, so that the refusal is logged too), or a new one."""
    given = body.get(field)
    return shown_id(given) if isinstance(given, str) and given else new_id(prefix)


def check_request_id(value: Any, field: str) -> None:
    """A client's request id over gRPC's bound (codec.MAX_REQUEST_ID bytes) is INVALID_ARGUMENT."""
    if isinstance(value, str):
        check_name(value, field)


def detokenize_ids(value: Any, field: str) -> np.ndarray:
    """Ids to detokenize as int32, their count checked against gRPC Detokenize's cap before conversion."""
    if isinstance(value, list):
        check_detokenize_count(len(value), field)
    return id_array(value, field)


def clamp(values: np.ndarray, floor: float = -9999.0) -> list:
    """float32 values as Python floats (their exact float64 value, printed as vLLM prints them), -inf -> floor."""
    return np.maximum(values.astype(np.float64), floor).tolist()


def b64_array(arr: np.ndarray) -> str:
    import base64

    return base64.b64encode(np.ascontiguousarray(arr).tobytes()).decode("ascii")


def npy_b64(arr: np.ndarray) -> str:
    """An array as base64 of its .npy file (header with dtype and shape, then the bytes)."""
    import base64
    import io

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def new_id(prefix: str) -> str:
    import secrets

    return f"{prefix}-{secrets.token_hex(8)}"
