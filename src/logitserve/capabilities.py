"""What the installed torch offers the CUDA paths, probed once at start-up (APIs that moved between versions).

The server runs on whatever torch a GPU machine has (the lent image: 2.11). Each path that uses an
API newer than the floor asks here first and falls back where it is missing, so a first run on a new
machine degrades with one logged line instead of failing every request:
- `mm_out_dtype`: torch.mm(bf16, bf16, out_dtype=float32), the head GEMM with fp32 output on CUDA
  (without it the logits are rounded to bf16 before the upcast: 0.125 steps at |z| in 16..32);
- `varlen_attn` / `varlen_gqa` / `varlen_window` / `varlen_causal`: torch.nn.attention.varlen.varlen_attn, and
  which of its enable_gqa, window_size and is_causal arguments it takes (logitserve.attention);
- `nccl_device_id`: init_process_group(device_id=...), which binds NCCL to the rank's GPU at once;
- `fp8_rowwise` / `fp8_block`: the FP8 GEMMs an FP8 checkpoint's linear layers run in bf16 (logitserve.fp8_linear:
  torch._scaled_mm row-wise, F.scaled_mm with 1x128 x 128x128 block scales), each checked on a tiny GEMM.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

log = logging.getLogger("logitserve.capabilities")


@dataclass(frozen=True)
class Capabilities:
    torch: str
    cuda: bool
    device_name: str
    mm_out_dtype: bool      # fp32-output GEMM from bf16/fp16 inputs on this device
    varlen_attn: bool       # flash varlen attention importable (a CUDA build; the kernel is checked on first use)
    varlen_gqa: bool        # varlen_attn takes enable_gqa (else KV heads are repeated)
    varlen_window: bool     # varlen_attn takes window_size (causal and sliding-window masks)
    varlen_causal: bool     # varlen_attn takes is_causal (causal masks only)
    nccl: bool
    nccl_device_id: bool    # init_process_group takes device_id
    fp8_rowwise: bool = False   # row-wise FP8 GEMM (compressed-tensors per-channel checkpoints) runs, bf16 out
    fp8_block: bool = False     # 128x128 block-scaled FP8 GEMM (DeepSeek / Qwen3-FP8 checkpoints) runs, bf16 out

    def as_dict(self) -> dict:
        return asdict(self)


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _mm_out_dtype(device: str) -> bool:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _fp8(device: str) -> dict:
    from .fp8_linear import probe as fp8_probe

    gemms = fp8_probe(device, torch.bfloat16)
    return {"fp8_rowwise": gemms.rowwise, "fp8_block": gemms.block}


@lru_cache(maxsize=None)
def probe(device: str = "cpu") -> Capabilities:
    """The capabilities for `device` ("cpu", "cuda", "cuda:1"), probed once per device."""
    import torch.distributed as dist

    try:
        from torch.nn.attention.varlen import varlen_attn
        varlen = True
        gqa, window, causal = (_takes(varlen_attn, n) for n in ("enable_gqa", "window_size", "is_causal"))
    except ImportError:
        varlen = gqa = window = causal = False
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    caps = Capabilities(
        torch=torch.__version__, cuda=cuda, device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
        mm_out_dtype=_mm_out_dtype(device), varlen_attn=varlen, varlen_gqa=gqa,
        varlen_window=window, varlen_causal=causal,
        nccl=dist.is_available() and dist.is_nccl_available(),
        nccl_device_id=dist.is_available() and _takes(dist.init_process_group, "device_id"),
        **_fp8(device))
    if cuda:
        missing = [n for n in ("mm_out_dtype", "varlen_attn", "nccl_device_id") if not getattr(caps, n)]
        if missing:
            log.warning("torch %s on %s lacks %s: the fallbacks run (see logitserve.capabilities)",
                        caps.torch, caps.device_name, ", ".join(missing))
    return caps


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(probe(sys.argv[1] if len(sys.argv) > 1 else "cpu").as_dict()))
