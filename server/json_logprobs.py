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
    """Per-id JSON pieces `"<id>":{"logprob":` and `,"decoded_token":"<text>"},` (object arrays over V), and per-rank
    `,"rank":<r>` (ranks 0..V). Every entry ends in a comma, so a row is one join of its pieces less its last byte."""

    def __init__(self, texts, vocab: int):
        self._texts = texts
        self._vocab = vocab
        self._head = self._tail = self._rank = None

    @classmethod
    def prebuilt(cls, head: np.ndarray, tail: np.ndarray, rank: np.ndarray) -> "VocabTables":
        """Tables built elsewhere (the encoding process gets the server's: server/encode_process.py)."""
        tables = cls(None, len(head))
        tables._head, tables._tail, tables._rank = head, tail, rank
        return tables

    def _build(self) -> None:
        texts = self._texts.of(np.arange(self._vocab)) if self._texts.available else [None] * self._vocab
        self._head = np.array([b'"%d":{"logprob":' % i for i in range(self._vocab)], dtype=object)
        self._tail = np.array([b',"decoded_token":' + orjson.dumps(t) + b"}," for t in texts], dtype=object)
        self._rank = np.array([b',"rank":%d' % r for r in range(self._vocab + 1)], dtype=object)

    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._head is None:
            self._build()
        return self._head, self._tail, self._rank


def _texts(values: np.ndarray) -> list[bytes]:
    """Each value's JSON text, in order (printed by orjson in one call). values: [n]"""
    return orjson.dumps(values.tolist())[1:-1].split(b",") if values.size else []


def _floats(values: np.ndarray) -> list[bytes]:
    """fp32 values as their float64 JSON text, -inf clamped to -9999.0. values: [n]"""
    return _texts(np.maximum(values.astype(np.float64), _FLOOR))


def _pieces(ids: np.ndarray, values: np.ndarray, ranks: np.ndarray, tables: VocabTables) -> np.ndarray:
    """Entries as their four pieces each (key and value head, value, rank, text and closing comma); joined in
    order they are the entries, each followed by a comma. ids/values/ranks: [n] -> [n, 4] object"""
    head, tail, rank = tables.tables()
    out = np.empty((len(ids), 4), dtype=object)
    out[:, 0] = head[ids]
    out[:, 1] = _floats(values)
    out[:, 2] = rank[ranks]
    out[:, 3] = tail[ids]
    return out


def _rows(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids, top_values,
          tables: VocabTables) -> bytes:
    """`{token first, then the top-k by rank},{...}`: the rows' objects, comma-separated, in one join.
    targets/logprobs/ranks: [n], top_ids/top_values: [n, k] or None."""
    n, k = len(targets), 0 if top_ids is None else top_ids.shape[1]
    pieces = _pieces(targets, logprobs, ranks, tables)[:, None]                                 # [n, 1, 4]
    last = np.zeros(n, dtype=np.int64)                                 # each row's last entry, by position
    if k:
        ranks_k = np.broadcast_to(np.arange(1, k + 1), (n, k)).reshape(-1)                     # [n * k]
        entries = _pieces(top_ids.reshape(-1), top_values.reshape(-1), ranks_k, tables).reshape(n, k, 4)
        dup = top_ids == targets[:, None]                              # the scored token is listed first only
        entries[dup] = b""
        pieces = np.concatenate([pieces, entries], axis=1)                                      # [n, 1 + k, 4]
        last[:] = np.where(dup[:, -1], k - 1, k)                       # ids are distinct: one dup at most
    rows = np.arange(n)
    pieces[rows, last, 3] = [t[:-1] + b"}," for t in pieces[rows, last, 3]]   # the last entry closes its row
    out = np.empty((n, 1 + pieces.shape[1] * 4), dtype=object)
    out[:, 0] = b"{"
    out[:, 1:] = pieces.reshape(n, -1)
    return b"".join(out.ravel())[:-1]


def _wide_row(target, logprob, rank, ids: np.ndarray, values: np.ndarray, tables: VocabTables):
    """One row of k > BLOCK_ENTRIES entries as JSON pieces, BLOCK_ENTRIES columns at a time (each numpy call on
    object arrays holds the GIL: short calls keep the event loop and the compute thread going)."""
    last = b"{" + b"".join(_pieces(target[None], logprob[None], rank[None], tables)[0])
    for c0 in range(0, len(ids), BLOCK_ENTRIES):
        cols = ids[c0 : c0 + BLOCK_ENTRIES]
        keep = cols != target
        block = _pieces(cols[keep], values[c0 : c0 + BLOCK_ENTRIES][keep],
                        np.arange(c0 + 1, c0 + 1 + len(cols))[keep], tables)
        if len(block):
            yield last
            last = b"".join(block.ravel())
    yield last[:-1] + b"}"                                                 # the last entry's comma closes the row


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
        yield sep + block
        sep = b","
    yield b"]"


def prompt_logprobs(targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, top_ids: np.ndarray,
                    top_values: np.ndarray, leading_nulls: int, tables: VocabTables) -> orjson.Fragment:
    """The whole list at once (an orjson.Fragment that orjson embeds as is)."""
    return orjson.Fragment(b"".join(prompt_logprobs_parts(targets, logprobs, ranks, top_ids, top_values,
                                                          leading_nulls, tables)))
