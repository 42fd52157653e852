"""Several teachers behind one client: each row routed by its teacher id, every teacher's share sent at once."""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

from .api import OutputsMixin
from .assemble import ForwardResult
from .errors import LogitServeError
from .scatter import check_per_sequence
from .sync import result_off_loop
from .wire import Wanted

# ForwardResult's fields that hold one entry per sequence (reordered on merge); the rest describe a whole answer
PER_ROW = tuple(f.name for f in dataclasses.fields(ForwardResult)
                if f.name not in ("applied", "model", "batching", "shared_prefix_tokens"))


@dataclass
class RoutedResult(ForwardResult):
    """A ForwardResult over every row in input order, with whose row is whose.

    `applied`, `model` and `batching` are set where every teacher agrees and None otherwise;
    `results` holds each teacher's own ForwardResult (its rows in input order among its own)."""

    teacher: tuple = ()                                    # [B] the teacher id of each row
    results: dict = field(default_factory=dict)            # teacher id -> ForwardResult of its rows


def route(teacher: Sequence, n: int, known) -> dict[Any, list[int]]:
    """Row indices per teacher id, in input order; ValueError naming the row for a length or an unknown id."""
    ids = list(teacher) if not isinstance(teacher, str) else None
    if ids is None or len(ids) != n:
        got = "a str" if ids is None else f"{len(ids)} ids"
        raise ValueError(f"teacher: one id per sequence is needed, {got} given for {n} sequences")
    if n == 0:
        raise ValueError("seqs: at least one sequence is needed")
    rows: dict[Any, list[int]] = {}
    for i, t in enumerate(ids):
        if t not in known:
            raise ValueError(f"teacher[{i}]={t!r}: not one of the teachers {sorted(map(str, known))}")
        rows.setdefault(t, []).append(i)
    return rows


def share(wanted: Wanted, rows: list[int]) -> Wanted:
    """The request for these rows: the per-sequence options (prompt_lengths, candidates) cut to them."""
    def cut(values, name):
        if values is None:
            return None
        values = list(values)
        if len(values) <= rows[-1]:
            raise ValueError(f"{name}: {len(values)} given, but row {rows[-1]} needs one")
        return [values[i] for i in rows]
    return dataclasses.replace(wanted, prompt_lengths=cut(wanted.prompt_lengths, "prompt_lengths"),
                               candidates=cut(wanted.candidates, "candidates"))


def merge(n: int, parts: dict[Any, tuple[list[int], ForwardResult]]) -> RoutedResult:
    """One RoutedResult of `n` rows from each teacher's (rows, result)."""
    out = RoutedResult()
    order: list = [None] * n
    for name in PER_ROW:
        if all(getattr(r, name) is None for _, r in parts.values()):
            continue
        column: list = [None] * n
        for rows, r in parts.values():
            values = getattr(r, name)
            for i, row in enumerate(rows):
                column[row] = None if values is None else values[i]
        setattr(out, name, column)
    for t, (rows, _) in parts.items():
        for row in rows:
            order[row] = t
    results = [r for _, r in parts.values()]
    for name in ("applied", "model", "batching"):
        values = {getattr(r, name) for r in results}
        setattr(out, name, values.pop() if len(values) == 1 else None)
    out.shared_prefix_tokens = sum(r.shared_prefix_tokens for r in results)
    out.teacher, out.results = tuple(order), {t: r for t, (_, r) in parts.items()}
    return out


def _named(teacher, error: BaseException) -> BaseException:
    """A teacher's LogitServeError with the teacher's id in its message (same status code)."""
    if isinstance(error, LogitServeError):
        return LogitServeError(error.code, f"teacher {teacher!r}: {error.details}")
    return error


class _Routed(OutputsMixin):
    """The output methods of OutputsMixin over one routing of rows (what Teachers' methods call)."""

    def __init__(self, owner, teacher: Sequence):
        self._owner, self._teacher = owner, teacher

    def _request(self, seqs: Sequence, wanted: Wanted, pick, bf16_as_torch: bool = False):
        return self._owner._request(seqs, wanted, pick, bf16_as_torch, self._teacher)


class _Teachers(Mapping):
    """What the sync and async groups share: the mapping, and the output methods with a `teacher` argument."""

    _async: bool

    def __init__(self, clients: Mapping):
        if not isinstance(clients, Mapping) or not clients:
            raise ValueError("clients: a non-empty mapping of teacher id -> client is needed")
        for name, c in clients.items():
            if not callable(getattr(c, "submit", None)):
                raise TypeError(f"clients[{name!r}]: {type(c).__name__} has no submit(seqs, wanted, bf16_as_torch)")
            if inspect.iscoroutinefunction(c.submit) != self._async:
                want, other = ("an async", "Teachers") if self._async else ("a blocking", "AsyncTeachers")
                raise TypeError(f"clients[{name!r}]: {type(c).__name__} is not {want} client; use {other}")
        self._clients = dict(clients)

    def __getitem__(self, teacher):
        return self._clients[teacher]

    def __iter__(self):
        return iter(self._clients)

    def __len__(self) -> int:
        return len(self._clients)

    def _plan(self, seqs: Sequence, wanted: Wanted, teacher: Sequence):
        """(teacher id, rows, its seqs, its Wanted) per teacher in the request."""
        check_per_sequence(wanted, len(seqs))
        rows = route(teacher, len(seqs), self._clients)
        return [(t, r, [seqs[i] for i in r], share(wanted, r)) for t, r in rows.items()]

    def routed(self, teacher: Sequence) -> OutputsMixin:
        """A client-like view whose output methods (no `teacher` argument) route rows by this `teacher` list."""
        return _Routed(self, teacher)

    def forward(self, seqs: Sequence, teacher: Sequence, **options):
        """TeacherClient.forward, each row answered by the teacher `teacher[i]` names: a RoutedResult."""
        return self.routed(teacher).forward(seqs, **options)

    def logprobs(self, seqs: Sequence, teacher: Sequence, *args, **options):
        """TeacherClient.logprobs with rows routed by `teacher`; one array per row, in input order."""
        return self.routed(teacher).logprobs(seqs, *args, **options)

    def topk(self, seqs: Sequence, teacher: Sequence, *args, **options):
        """TeacherClient.topk with rows routed by `teacher`: (values, ids), one array each per row."""
        return self.routed(teacher).topk(seqs, *args, **options)

    def candidate_logprobs(self, seqs: Sequence, teacher: Sequence, *args, **options):
        """TeacherClient.candidate_logprobs with rows routed by `teacher` (candidates per row, as given)."""
        return self.routed(teacher).candidate_logprobs(seqs, *args, **options)

    def full_logits(self, seqs: Sequence, teacher: Sequence, *args, **options):
        """TeacherClient.full_logits with rows routed by `teacher` (widths differ where vocabularies do)."""
        return self.routed(teacher).full_logits(seqs, *args, **options)

    def hidden_states(self, seqs: Sequence, teacher: Sequence, *args, **options):
        """TeacherClient.hidden_states with rows routed by `teacher`; `self[t].head()` is teacher t's head."""
        return self.routed(teacher).hidden_states(seqs, *args, **options)

    def scores(self, seqs: Sequence, teacher: Sequence):
        """TeacherClient.scores with rows routed by `teacher` (reward models)."""
        return self.routed(teacher).scores(seqs)


class Teachers(_Teachers):
    """`Teachers({"math": TeacherClient(a), "code": TeacherClient(b)})`: the output methods of a TeacherClient with
    a per-row `teacher` list; each teacher gets its rows in one request, all sent at once, answers in input order.

    Any blocking client with `submit(seqs, wanted, bf16_as_torch)` returning a concurrent Future fits
    (TeacherClient, a pool of replicas). A mapping of id -> client; `close()` closes them all."""

    _async = False

    def submit(self, seqs: Sequence, wanted: Wanted, teacher: Sequence,
               bf16_as_torch: bool = False) -> concurrent.futures.Future:
        """Every teacher's share sent now; a Future of the RoutedResult. The first teacher to fail fails it (its
        id in the message) and cancels the others; cancelling it cancels them all."""
        plan = self._plan(seqs, wanted, teacher)
        out: concurrent.futures.Future = concurrent.futures.Future()
        futures: dict = {}
        try:
            for t, _, sub, w in plan:
                futures[t] = self._clients[t].submit(sub, w, bf16_as_torch)
        except BaseException:
            for f in futures.values():
                f.cancel()
            raise
        parts: dict = {}
        lock = threading.Lock()

        def finished(t, rows: list[int], f: concurrent.futures.Future) -> None:
            with lock:
                if out.done():
                    return
                if f.cancelled():
                    outcome = concurrent.futures.CancelledError(f"teacher {t!r}: cancelled")
                elif f.exception() is not None:
                    outcome = _named(t, f.exception())
                else:
                    parts[t] = (rows, f.result())
                    if len(parts) < len(plan):
                        return
                    try:
                        outcome = merge(len(seqs), parts)
                    except Exception as e:      # noqa: BLE001 - reported through the future, as a teacher's error is
                        outcome = e
                try:
                    if isinstance(outcome, BaseException):
                        out.set_exception(outcome)
                    else:
                        out.set_result(outcome)
                except concurrent.futures.InvalidStateError:    # cancelled by the caller meanwhile
                    return
            if isinstance(outcome, BaseException):
                for other in futures.values():
                    other.cancel()

        out.add_done_callback(lambda o: o.cancelled() and [f.cancel() for f in futures.values()])
        for t, rows, _, _ in plan:
            futures[t].add_done_callback(lambda f, t=t, rows=rows: finished(t, rows, f))
        return out

    def _request(self, seqs, wanted, pick, bf16_as_torch=False, teacher=()):
        return pick(result_off_loop(self.submit(seqs, wanted, teacher, bf16_as_torch)))

    def close(self) -> None:
        for c in self._clients.values():
            c.close()

    def __enter__(self) -> "Teachers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncTeachers(_Teachers):
    """Teachers over async clients (AsyncTeacherClient, an async pool): the output methods return awaitables."""

    _async = True

    async def submit(self, seqs: Sequence, wanted: Wanted, teacher: Sequence,
                     bf16_as_torch: bool = False) -> RoutedResult:
        """Every teacher's share sent at once; the RoutedResult. The first failure (its teacher's id in the
        message) cancels the others."""
        plan = self._plan(seqs, wanted, teacher)
        tasks = {t: asyncio.ensure_future(self._clients[t].submit(sub, w, bf16_as_torch)) for t, _, sub, w in plan}
        try:
            done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
            for t, task in tasks.items():
                if task in done and task.exception() is not None:
                    raise _named(t, task.exception()) from None
            return merge(len(seqs), {t: (rows, tasks[t].result()) for t, rows, _, _ in plan})
        finally:
            pending = [task for task in tasks.values() if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    def _request(self, seqs, wanted, pick, bf16_as_torch=False, teacher=()):
        async def run():
            return pick(await self.submit(seqs, wanted, teacher, bf16_as_torch))
        return run()

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._clients.values()))

    async def __aenter__(self) -> "AsyncTeachers":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


__all__ = ["Teachers", "AsyncTeachers", "RoutedResult", "route", "share", "merge"]
