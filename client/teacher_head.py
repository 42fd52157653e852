"""TeacherHead: the teacher's lm_head as a torch module that turns served hidden states into the served logits.

The logits come out as the server computes them (SPEC.md, Head): h @ W^T + b with fp32
accumulation, rounded to the server's logits dtype where it rounds (bf16 teachers served
without an fp32-output GEMM), then in fp32 the model's post-head map (logit scale, logits
scaling, softcapping) and the temperature. `chunks` walks the rows so that [N, V] never
has to exist at once; `devices` splits V over the student's own devices.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch import nn

from logitserve.loading import DTYPES as _TORCH, HeadTransform   # "fp32" | "bf16" | "fp16" -> torch dtype

from .head import HeadSpec, HeadWeights

def _tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if dtype == "bf16" else t


class TeacherHead(nn.Module):
    """`head(h, temperature=1.0)`: h [..., H] (fp32 or bf16) -> z/T [..., V] fp32, equal to the served logits."""

    def __init__(self, weights: HeadWeights, device=None, dtype: Optional[torch.dtype] = None,
                 devices: Optional[Sequence] = None):
        """`dtype`: the weight's dtype here (default: the served one, which reproduces the server exactly; fp32
        keeps the same values and accumulates in fp32). `devices`: split the vocabulary over these devices
        (their logits are gathered on the first); else everything on `device` (default cpu)."""
        super().__init__()
        spec = weights.spec
        self.spec: HeadSpec = spec
        devices = list(devices) if devices else [device or "cpu"]
        self.devices = [torch.device(d) for d in devices]
        served = _TORCH[spec.dtype]
        if dtype is None:   # the served dtype; where the server accumulates bf16/fp16 in fp32 and no GPU GEMM
            fp32_off_gpu = spec.logits_dtype == "fp32" and all(d.type != "cuda" for d in self.devices)
            dtype = torch.float32 if fp32_off_gpu else served   # can do it, the same values in fp32
        self.dtype = dtype
        weight = _tensor(weights.weight, spec.dtype)                                      # [V, H]
        bias = _tensor(weights.bias, spec.dtype) if weights.bias is not None else None   # [V]
        bounds = np.linspace(0, spec.vocab_size, len(self.devices) + 1).round().astype(int)
        self.bounds = [(int(a), int(b)) for a, b in zip(bounds, bounds[1:])]
        self.weights = nn.ParameterList(
            nn.Parameter(weight[a:b].to(device=d, dtype=self.dtype), requires_grad=False)
            for (a, b), d in zip(self.bounds, self.devices))
        self.biases = [None if bias is None else bias[a:b].to(device=d, dtype=self.dtype)
                       for (a, b), d in zip(self.bounds, self.devices)]
        self.transform = HeadTransform(spec.multiply, spec.divide, spec.softcap or None)
        # the server rounds its logits to the served dtype first unless it accumulates them in fp32
        self._round_to = None if spec.logits_dtype == "fp32" else _TORCH[spec.logits_dtype]

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @torch.no_grad()
    def _shard(self, h: torch.Tensor, k: int) -> torch.Tensor:
        """Shard k's logits before the post-head map. h: [n, H] -> [n, V_k] fp32 on the shard's device."""
        w, b = self.weights[k], self.biases[k]
        x = h.to(device=w.device, dtype=self.dtype)
        if self.dtype == torch.float32 or self._round_to is not None:
            y = torch.nn.functional.linear(x, w, b)
            if self._round_to is not None:            # as the server: rounded to its logits dtype first
                y = y.to(self._round_to)
            return y.float()
        if w.device.type == "cuda":                   # fp32 output from bf16/fp16 inputs, as the server's GEMM
            try:
                y = torch.mm(x, w.t(), out_dtype=torch.float32)
            except (TypeError, RuntimeError):
                y = x.float() @ w.float().t()
        else:
            y = x.float() @ w.float().t()             # the same exact products, accumulated in fp32
        return y if b is None else y + b.float()

    @torch.no_grad()
    def forward(self, h: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """z/T [..., V] fp32 on the first device, for hidden states [..., H]."""
        lead = h.shape[:-1]
        flat = h.reshape(-1, h.shape[-1])                                                  # [n, H]
        parts = [self._shard(flat, k).to(self.devices[0]) for k in range(len(self.weights))]
        z = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)                      # [n, V]
        if not self.transform.identity:
            self.transform.apply_(z)
        if temperature != 1.0:
            z.div_(temperature)
        return z.reshape(*lead, self.spec.vocab_size)

    def chunks(self, h: torch.Tensor, rows: int = 512, temperature: float = 1.0) -> Iterator[tuple[slice, torch.Tensor]]:
        """(rows of h flattened to [N, H], their z/T [rows, V]) chunk by chunk: [N, V] never exists at once."""
        flat = h.reshape(-1, h.shape[-1])
        for a in range(0, flat.shape[0], rows):
            b = min(a + rows, flat.shape[0])
            yield slice(a, b), self.forward(flat[a:b], temperature)
