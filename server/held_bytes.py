"""The memory budget's books: bytes held by admitted requests, in all and per client, and the refusals.

A request holds its arrays (decoded and as received) and its output buffer from admission until
it ends; an HTTP answer holds its estimated bytes until its last byte is sent; tokenizing a text
holds its estimate while it runs. A request is refused (OverLimit, a status the client may retry)
when the bytes held plus its own and its estimated peak would pass `--memory-budget`, or its
client's share (half); TooLarge (never admissible) when it is over the budget even alone. Not
thread-safe: the scheduler holds its lock around every call.
"""
from __future__ import annotations

from typing import Optional

from logitserve.errors import OverLimit, TooLarge

from .admission import Tally

_MiB = 2 ** 20


class HeldBytes:
    def __init__(self, budget_bytes: Optional[int], client_bytes: Optional[int]):
        self.bytes = budget_bytes                    # None: no budget
        self.client_bytes = client_bytes             # one client's share (SchedulerConfig.client_budget_bytes)
        self._held = Tally()

    @property
    def held(self) -> int:
        return self._held.total

    def check(self, client: str, hold: int, peak: int) -> None:
        """OverLimit when `hold` more bytes (and `peak` for a moment) would pass the budget or the client's share."""
        if self.bytes is None:
            return
        if self._held.total + hold + peak > self.bytes:
            raise OverLimit(f"memory: {self._held.total / _MiB:.0f} MiB held by requests in flight + {hold / _MiB:.0f} "
                            f"MiB for this one (+{peak / _MiB:.0f} MiB at its peak) is over --memory-budget "
                            f"{self.bytes / _MiB:.0f} MiB; retry later")
        mine = self._held.of(client)
        if mine + hold > self.client_bytes:
            raise OverLimit(f"memory: this client ({client}) holds {mine / _MiB:.0f} MiB in requests in flight; "
                            f"+{hold / _MiB:.0f} MiB is over its share, half of --memory-budget "
                            f"({self.client_bytes / _MiB:.0f} MiB); read or end some first")

    def check_peak(self, peak: int, longest: int) -> None:
        """TooLarge when the request's estimated peak alone passes the budget (`longest`: its longest sequence)."""
        if self.bytes is not None and peak > self.bytes:
            raise TooLarge(f"request needs ~{peak / _MiB:.0f} MiB at peak (longest sequence {longest} tokens), over "
                           f"--memory-budget {self.bytes / _MiB:.0f} MiB")

    def check_alone(self, hold: int, peak: int) -> None:
        """TooLarge when the request's held bytes and peak together pass the budget."""
        if self.bytes is not None and hold + peak > self.bytes:
            raise TooLarge(f"memory: this request needs ~{hold / _MiB:.0f} MiB held (its arrays and an output buffer "
                           f"of up to --max-buffered-bytes) + ~{peak / _MiB:.0f} MiB at its peak, over --memory-budget "
                           f"{self.bytes / _MiB:.0f} MiB even alone; send less per request")

    def check_outside(self, nbytes: int, what: str) -> None:
        """TooLarge when work outside a job's buffer needs more than one client's share."""
        if self.bytes is not None and nbytes > self.client_bytes:
            raise TooLarge(f"{what} needs ~{nbytes / _MiB:.0f} MiB, over half of --memory-budget "
                           f"({self.client_bytes / _MiB:.0f} MiB)")

    def add(self, client: str, nbytes: int) -> None:
        self._held.add(client, nbytes)

    def remove(self, client: str, nbytes: int) -> None:
        self._held.remove(client, nbytes)
