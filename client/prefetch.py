"""A prefetching teacher: wraps a student's batches and keeps the next ones' teacher requests in flight."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable, Iterator, Optional

from .wire import Wanted


class PrefetchingTeacher:
    """Iterate (batch, teacher result) with `depth` batches' requests on the stream ahead of the student.

    `ids_of(batch)` gives the batch's token-id sequences (or texts); `attach(result)` turns the
    ForwardResult into what the loop wants, e.g. `lambda r: TeacherBatch.from_result(r, device="cuda")`.
    While the student runs its step on batch i, the teacher is already computing batches i+1..i+depth;
    the student waits only when the teacher is slower than its step. Results come in batch order; a
    failed request raises its LogitServeError when its batch comes up.
    """

    def __init__(self, teacher, batches: Iterable, wanted: Wanted, ids_of: Callable[[Any], Any] = lambda b: b,
                 depth: int = 2, attach: Optional[Callable[[Any], Any]] = None):
        if depth < 1:
            raise ValueError(f"depth={depth} must be >= 1 (requests in flight ahead of the student)")
        self._teacher, self._batches, self._wanted = teacher, batches, wanted
        self._ids_of, self._depth, self._attach = ids_of, depth, attach
        self.max_in_flight = 0          # the most requests seen on the stream at once (for checks)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        source = iter(self._batches)
        pending: deque = deque()

        def top_up() -> None:
            while len(pending) < self._depth:
                batch = next(source, _END)
                if batch is _END:
                    return
                pending.append((batch, self._teacher.submit(self._ids_of(batch), self._wanted)))
                self.max_in_flight = max(self.max_in_flight, sum(not f.done() for _, f in pending))

        top_up()
        try:
            while pending:
                batch, future = pending.popleft()
                result = future.result()
                top_up()                          # the next request goes out before the student's step
                yield batch, (self._attach(result) if self._attach else result)
        finally:
            for _, future in pending:             # the loop stopped early: drop what it will not read
                future.cancel()


_END = object()
