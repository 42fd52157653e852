"""Where each rank sits in the tp x cp grid; the single-process layout is the 1 x 1 case."""
from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class RankPlace:
    rank: int
    tp_rank: int
    cp_rank: int
    host: str
    device: str
    pp_rank: int = 0


@dataclass(frozen=True)
class Layout:
    tp: int
    cp: int
    ranks: tuple[RankPlace, ...]
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp


def single_process(device: str = "cpu") -> Layout:
    return Layout(tp=1, cp=1, ranks=(RankPlace(0, 0, 0, socket.gethostname(), device),))
