"""One dense collector for every front-end that answers whole: pieces into one array per output and sequence.

KServe answers each output as one zero-padded [B, ...] tensor (`padded`); the HTTP shapes read each
sequence's own array (`of`). Both collect the same way: every piece written at its offset into its
sequence's array of the piece's full shape, zeros where no piece wrote. Tensors stay torch (BF16
has no numpy dtype); `of` hands numpy views. No math here.
"""
from __future__ import annotations

from typing import AsyncIterator, Optional

import numpy as np
import torch

from logitserve.engine import Piece
from logitserve.spec import OutputKind


class Dense:
    """Each output of each of `count` sequences as one array, filled from a request's pieces."""

    def __init__(self, count: int):
        self.count = count
        # output -> per sequence, an array of its full shape (or, once `padded`, one [B, ...] tensor)
        self._arrays: dict[OutputKind, list[Optional[torch.Tensor]] | torch.Tensor] = {}

    @classmethod
    async def collect(cls, pieces: AsyncIterator[Piece], count: int) -> "Dense":
        """Every piece of a request's run (Request.run) into a new collector of `count` sequences."""
        dense = cls(count)
        async for piece in pieces:
            dense.add(piece)
        return dense

    def add(self, piece: Piece) -> None:
        per = self._arrays.setdefault(piece.output, [None] * self.count)
        arr = per[piece.sequence]
        if arr is None:
            arr = per[piece.sequence] = torch.zeros(piece.full_shape, dtype=piece.tensor.dtype)
        arr[tuple(slice(o, o + d) for o, d in zip(piece.offset, piece.tensor.shape))] = piece.tensor

    def of(self, output: OutputKind, sequence: int) -> Optional[np.ndarray]:
        """One sequence's array of `output` (a numpy view), or None when no piece of it came."""
        per = self._arrays.get(output)
        arr = None if per is None else per[sequence]
        return None if arr is None else arr.numpy()

    def padded(self, output: OutputKind) -> Optional[torch.Tensor]:
        """`output` as one [B, ...] tensor, each sequence's array zero-padded to the largest; None when no piece
        of it came. It replaces the sequences' own arrays (the answer is held once, not twice)."""
        per = self._arrays.get(output)
        if isinstance(per, torch.Tensor) or per is None:
            return per
        present = [a for a in per if a is not None]
        if not present:
            return None
        shape = tuple(max(dims) for dims in zip(*(a.shape for a in present)))
        out = torch.zeros((self.count, *shape), dtype=present[0].dtype)
        del present
        for b in range(self.count):
            a, per[b] = per[b], None
            if a is not None:
                out[(b, *(slice(0, d) for d in a.shape))] = a
        self._arrays[output] = out
        return out
