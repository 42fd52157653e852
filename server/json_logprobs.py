"""vLLM's prompt_logprobs list as JSON bytes, built column-wise from numpy arrays instead of a dict per entry.

An entry is `"<id>":{"logprob":<v>,"rank":<r>,"decoded_token":"<text>"}`. Everything in it but
the value depends only on the id (key, text) or the top-k column (rank), so each piece comes from
a table indexed by a whole array at once; the values are printed by orjson (the float64 repr of
each fp32 value, as vLLM prints them). The result is an orjson.Fragment that orjson embeds as is.
Byte for byte what json.dumps of vLLM's dicts gives (tests/test_http.py compares the parsed values).
"""
from __future__ import annotations

import numpy as np
import orjson

_FLOOR = -9999.0      # vLLM clamps -inf logprobs to this (JSON has no infinity)


class VocabTables:
    """Per-id JSON pieces: `"<id>":{"logprob":` and `,"decoded_token":"<text>"}` (object arrays over V)."""

    def __init__(self, texts, vocab: int):
        self._texts = texts
        self._vocab = vocab
        self._head = self._tail = None

    def _build(self) -> None:
        ids = np.arange(self._vocab)
        texts = self._texts.of(ids) if self._texts.available else [None] * self._vocab
        self._head = np.array([b'"%d":{"logprob":' % i for i in range(self._vocab)], dtype=object)
        self._tail = np.array([b',"decoded_token":' + orjson.dumps(t) + b"}" for t in texts], dtype=object)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        if self._head is None:
            self._build()
        return self._head, self._tail


def _texts(values: np.ndarray) -> np.ndarray:
    """Each value's JSON text, as an object array of bytes of the same shape (printed by orjson in one call)."""
    text = orjson.dumps(values.reshape(-1).tolist())[1:-1]
    parts = np.array(text.split(b","), dtype=object) if values.size else np.zeros(0, dtype=object)
    return parts.reshape(values.shape)


def _floats(values: np.ndarray) -> np.ndarray:
    """fp32 values as their float64 JSON text, -inf clamped to -9999.0."""
    return _texts(np.maximum(values.astype(np.float64), _FLOOR))


def _firsts(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, tables: VocabTables) -> np.ndarray:
    """The scored token's entry of each row: its id's pieces, its value and its rank. [n] object"""
    head, tail = tables.tables()
    return head[targets] + _floats(logprobs) + (b',"rank":' + _texts(ranks)) + tail[targets]


def _entries(ids: np.ndarray, values: np.ndarray, col0: int, tables: VocabTables) -> np.ndarray:
    """Top-k entries of columns col0.. (rank = column + 1). ids/values: [n, c] -> [n, c] object"""
    head, tail = tables.tables()
    rank_text = np.array([b',"rank":%d' % (r + 1) for r in range(col0, col0 + ids.shape[1])], dtype=object)
    return head[ids] + _floats(values) + rank_text[None, :] + tail[ids]


def _rows(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids, top_values,
          tables: VocabTables) -> list[bytes]:
    """One `{token first, then the top-k by rank}` object per row. targets/logprobs/ranks: [n],
    top_ids/top_values: [n, k] or None."""
    first = _firsts(targets, logprobs, ranks, tables)                                           # [n]
    if top_ids is None or not top_ids.shape[1]:
        return [b"{" + e + b"}" for e in first]
    entries = _entries(top_ids, top_values, 0, tables)                                          # [n, k]
    dup = top_ids == targets[:, None]                                                           # [n, k]
    has_dup = dup.any(axis=1)
    rows = []
    for j in range(len(targets)):
        row = entries[j]
        if has_dup[j]:
            row = row[~dup[j]]
        rows.append(b"{" + first[j] + b"," + b",".join(row) + b"}" if len(row) else b"{" + first[j] + b"}")
    return rows


def _wide_row(target, logprob, rank, ids: np.ndarray, values: np.ndarray, tables: VocabTables):
    """One row of k > BLOCK_ENTRIES entries as JSON pieces, BLOCK_ENTRIES columns at a time (each numpy call on
    object arrays holds the GIL: short calls keep the event loop and the compute thread going)."""
    yield b"{" + _firsts(target[None], logprob[None], rank[None], tables)[0]
    for c0 in range(0, len(ids), BLOCK_ENTRIES):
        cols = ids[c0 : c0 + BLOCK_ENTRIES]
        row = _entries(cols[None], values[None, c0 : c0 + BLOCK_ENTRIES], c0, tables)[0]
        row = row[cols != target]                                      # the scored token is listed first only
        if len(row):
            yield b"," + b",".join(row)
    yield b"}"


# Entries encoded at a time when the list is produced in parts: entries are ~100 bytes, so a block keeps the
# temporaries under a MiB whatever the answer's size, and each numpy call on them short.
BLOCK_ENTRIES = 1 << 12


def prompt_logprobs_parts(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
                          top_values: np.ndarray, leading_nulls: int, tables: VocabTables):
    """`[null x leading_nulls, {token first, then the top-k by rank}, ...]` as JSON bytes, a block of rows (or
    of one row's columns) at a time. targets/logprobs/ranks: [n], top_ids/top_values: [n, k] (or None)."""
    n = len(targets)
    k = top_ids.shape[1] if top_ids is not None else 0
    yield b"[" + b",".join([b"null"] * leading_nulls)
    sep = b"," if leading_nulls else b""
    if k > BLOCK_ENTRIES:
        for j in range(n):
            yield sep
            yield from _wide_row(targets[j], logprobs[j], ranks[j], top_ids[j], top_values[j], tables)
            sep = b","
        yield b"]"
        return
    step = max(1, BLOCK_ENTRIES // max(k, 1))
    for at in range(0, n, step):
        end = min(at + step, n)
        block = _rows(targets[at:end], logprobs[at:end], ranks[at:end],
                      None if top_ids is None else top_ids[at:end], None if top_values is None else top_values[at:end],
                      tables)
        yield sep + b",".join(block)
        sep = b","
    yield b"]"


def prompt_logprobs(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
                    top_values: np.ndarray, leading_nulls: int, tables: VocabTables) -> orjson.Fragment:
    """The whole list at once (an orjson.Fragment that orjson embeds as is)."""
    return orjson.Fragment(b"".join(prompt_logprobs_parts(targets, logprobs, ranks, top_ids, top_values,
                                                          leading_nulls, tables)))
