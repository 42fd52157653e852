"""FP8 checkpoints a piece at a time: quantization_config refusals, header checks naming the tensor, a shard's block
scales and its dequantization against transformers' own, the FP8 GEMM's selection and the layout of scales it takes."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from helpers import quant_config, quantize
from logitserve.checkpoint import Checkpoint, Source
from logitserve.fp8_linear import Fp8Gemms, Fp8Linear, choose, prepare_scale, probe
from logitserve.quant import QuantError, QuantScheme, check_tensors, scheme_of
from logitserve.tp_plan import ParamShard

pytestmark = pytest.mark.unit

BLOCK = QuantScheme("fp8", "block", (128, 48), "weight_scale_inv")
INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}


def test_served_schemes_are_read_from_config_json():
    deepseek = scheme_of({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                          "weight_block_size": [128, 128]})
    assert deepseek == QuantScheme("fp8", "block", (128, 128), "weight_scale_inv", "dynamic", "float")
    assert deepseek.name == "fp8-block-128x128"
    for strategy in ("channel", "tensor"):
        got = scheme_of(quant_config(strategy))
        assert (got.method, got.strategy, got.scale_name, got.activations, got.name) == \
            ("compressed-tensors", strategy, "weight_scale", "dynamic", f"fp8-{strategy}")
    ct_block = quant_config("channel")
    ct_block["config_groups"]["group_0"]["weights"].update(strategy="block", block_structure=[128, 64])
    assert scheme_of(ct_block).name == "fp8-block-128x64"
    static = quant_config("channel")
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    assert scheme_of(static).activations == "static"
    assert scheme_of(None) is None


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method 'awq' is not served; served: FP8 e4m3 checkpoints"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method 'gptq' is not served"),
    ({"load_in_4bit": True}, r"quant_method 'bitsandbytes' is not served"),
    (INT4, r"config_groups.group_0.weights: int 4-bit weights \(format 'pack-quantized'\) are not served"),
    ({"quant_method": "magic"}, r"quant_method 'magic' is unknown \(transformers knows .*awq.*\)"),
    ({}, r"quantization_config has no quant_method; served"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]},
     r"fmt 'e5m2' \(quant_method 'fp8'\) is not served; served: fmt 'e4m3'"),
    ({"quant_method": "fp8", "activation_scheme": "per-head"}, r"Activation scheme per-head not supported"),
    ({**quant_config("channel"), "sparsity_config": {"format": "sparse-24"}}, r"sparsity_config .* not served"),
    ({**quant_config("channel"), "format": "int-quantized"}, r"format 'int-quantized' is not served"),
])
def test_unserved_quantization_configs_are_refused_in_one_line_naming_them(qc, match):
    with pytest.raises(QuantError, match=match) as e:
        scheme_of(qc)
    assert "\n" not in str(e.value)


def _meta(**tensors):
    return {k.replace("__", "."): v for k, v in tensors.items()}


def test_header_checks_name_the_tensor_and_what_is_served():
    ok = _meta(a__weight=("F8_E4M3", (200, 100)), a__weight_scale_inv=("F32", (2, 3)), b__weight=("BF16", (4, 4)))
    assert check_tensors(ok, BLOCK) == {"a.weight": "a.weight_scale_inv"}     # 200 = 128 + 72, 100 = 2 x 48 + 4
    cases = [
        (_meta(a__weight=("F8_E4M3", (200, 100))), BLOCK,
         r"FP8 weight a.weight has no scale: a.weight_scale_inv is missing"),
        (_meta(a__weight=("F8_E4M3", (200, 100)), a__weight_scale_inv=("F32", (2, 2))), BLOCK,
         r"scale a.weight_scale_inv has shape \[2, 2\]; weight a.weight \[200, 100\] with 128x48 blocks needs \[2, 3\]"),
        (_meta(a__weight=("F8_E4M3", (200, 100)), a__weight_scale_inv=("I32", (2, 3))), BLOCK,
         r"scale a.weight_scale_inv is stored as I32; served: F32, BF16, F16"),
        (_meta(a__weight=("F8_E4M3", (8, 8))), None,
         r"tensor a.weight is stored as F8_E4M3 but config.json has no quantization_config"),
        (_meta(a__weight=("F8_E5M2", (8, 8)), a__weight_scale_inv=("F32", (1, 1))), BLOCK,
         r"tensor a.weight is stored as F8_E5M2; served: F8_E4M3"),
        (_meta(a__weight=("BF16", (8, 8)), a__weight_scale_inv=("F32", (1, 1))), BLOCK,
         r"scale a.weight_scale_inv belongs to no FP8 weight: a.weight is BF16"),
        (_meta(a__bias=("F8_E4M3", (8,))), BLOCK, r"tensor a.bias is FP8 \[8\] but not a weight matrix"),
    ]
    for meta, scheme, match in cases:
        with pytest.raises(QuantError, match=match):
            check_tensors(meta, scheme, "ckpt")
    channel, tensor = scheme_of(quant_config("channel")), scheme_of(quant_config("tensor"))
    for shape in ((6, 1), (6,)):
        assert check_tensors(_meta(a__weight=("F8_E4M3", (6, 4)), a__weight_scale=("BF16", shape)), channel)
    for shape in ((), (1,)):
        assert check_tensors(_meta(a__weight=("F8_E4M3", (6, 4)), a__weight_scale=("F32", shape)), tensor)
    with pytest.raises(QuantError, match=r"needs \[6, 1\]"):
        check_tensors(_meta(a__weight=("F8_E4M3", (6, 4)), a__weight_scale=("BF16", (4, 1))), channel)


def _saved(tmp_path, w, fmt, block=None):
    q, scale, dq = quantize(w, fmt, block)
    name = "weight_scale_inv" if fmt == "block" else "weight_scale"
    save_file({"lin.weight": q, f"lin.{name}": scale}, tmp_path / "model.safetensors")
    scheme = scheme_of(quant_config(fmt, block))
    return Checkpoint(tmp_path, scheme), q, scale, dq


def test_dequantized_shards_equal_transformers_dequantization_of_the_whole(tmp_path):
    """A rank's slice (rows, columns, a packed part's rows, vocab rows) of a block-FP8 weight whose blocks are partial
    at both edges and cut by every shard edge: exactly the slice of transformers' dequantization of the whole."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    w = torch.randn(200, 100, generator=torch.Generator().manual_seed(0))
    ckpt, q, scale, dq = _saved(tmp_path, w, "block", (64, 48))        # 200 = 3 x 64 + 8, 100 = 2 x 48 + 4
    ref = _dequantize_fp8_weight(q, scale, [64, 48], torch.float32)      # [200, 100]
    assert torch.equal(ref, dq.float())                                  # the helper's float64 convention agrees
    src = Source(keys=[(-1, 0, "lin.weight")])
    assert torch.equal(ckpt.read("lin.weight", src, None, 0, 1), ref)
    for tp in (2, 4):
        for dim in (0, 1):
            size = ref.shape[dim] // tp
            for rank in range(tp):
                got = ckpt.read("lin.weight", src, ParamShard(dim), rank, tp)
                assert torch.equal(got, ref.narrow(dim, rank * size, size)), (tp, dim, rank)
    halves = ckpt.read("lin.weight", src, ParamShard(0, parts=2), 1, 2)   # fused gate|up: rank 1 of each half
    assert torch.equal(halves, torch.cat([ref[50:100], ref[150:200]]))
    assert torch.equal(ckpt.read_rows("lin.weight", 70, 130), ref[70:130])


def test_channel_and_tensor_scales_follow_their_rows(tmp_path):
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    for fmt in ("channel", "tensor"):
        (tmp_path / fmt).mkdir()
        ckpt, q, scale, dq = _saved(tmp_path / fmt, w, fmt)
        src = Source(keys=[(-1, 0, "lin.weight")])
        for dim in (0, 1):
            got = ckpt.read("lin.weight", src, ParamShard(dim), 1, 2)
            assert torch.equal(got, dq.float().narrow(dim, w.shape[dim] // 2, w.shape[dim] // 2)), (fmt, dim)


def test_fp8_shards_keep_whole_blocks_with_their_scales(tmp_path):
    """The FP8 GEMM path reads a rank's FP8 weight as stored and the scale blocks of that shard: rows under a column
    plan, columns under a row plan; a shard edge that cuts a block is named with its dimension and bound."""
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(2))
    ckpt, q, scale, _ = _saved(tmp_path, w, "block", (128, 128))         # scale [4, 3]
    src = Source(keys=[(-1, 0, "lin.weight")])
    for rank in range(2):
        assert ckpt.unaligned("lin.weight", src, ParamShard(0), rank, 2) is None
        wq, s = ckpt.read_fp8(src, ParamShard(0), rank, 2)
        assert wq.dtype == torch.float8_e4m3fn
        assert torch.equal(wq.view(torch.uint8), q[256 * rank:256 * (rank + 1)].view(torch.uint8))
        assert torch.equal(s, scale[2 * rank:2 * rank + 2])
    for rank in range(3):
        wq, s = ckpt.read_fp8(src, ParamShard(1), rank, 3)
        assert torch.equal(wq.view(torch.uint8), q[:, 128 * rank:128 * (rank + 1)].view(torch.uint8))
        assert torch.equal(s, scale[:, rank:rank + 1])
    why = ckpt.unaligned("lin.weight", src, ParamShard(0), 1, 8)          # 64 rows a rank
    assert why == ("lin.weight: its rows (out features) [64, 128) of 512 do not start and end on the 128-wide scale "
                   "blocks (a shard of 64 is not a multiple of 128)")
    assert "columns (in features) [96, 192) of 384" in ckpt.unaligned("lin.weight", src, ParamShard(1), 1, 4)


CUDA = torch.device("cuda")
BOTH = Fp8Gemms(rowwise=True, block=True)


def test_fp8_gemm_selection():
    """auto: FP8 GEMMs on a CUDA device that runs them when serving bf16, else dequantized with the reason; fp8: the
    same reasons refuse; dequantize: never."""
    deepseek = QuantScheme("fp8", "block", (128, 128), "weight_scale_inv")
    channel = scheme_of(quant_config("channel"))
    bf16 = torch.bfloat16
    assert choose("auto", CUDA, bf16, BOTH, deepseek, "w", (256, 512), None) == ("block", "")
    assert choose("auto", CUDA, bf16, BOTH, channel, "w", (48, 32), None) == ("rowwise", "")
    assert choose("auto", torch.device("cpu"), bf16, BOTH, deepseek, "w", (256, 512), None) == \
        (None, "no FP8 GEMMs on cpu")
    assert choose("auto", CUDA, torch.float32, BOTH, deepseek, "w", (256, 512), None)[1] == \
        "serving in float32 (FP8 GEMMs serve bf16)"
    assert choose("dequantize", CUDA, bf16, BOTH, deepseek, "w", (256, 512), None) == \
        (None, "--fp8-compute dequantize")
    reasons = [
        (QuantScheme("fp8", "block", (64, 64), "weight_scale_inv"), (256, 512), None, BOTH,
         "64x64 weight blocks (the block GEMM takes 128x128)"),
        (deepseek, (256, 512), "w: its rows ...", BOTH, "w: its rows ..."),
        (deepseek, (256, 200), None, BOTH, "w: its local shape [256, 200] is not a multiple of the 128-wide blocks"),
        (channel, (40, 32), None, BOTH, "w: its local shape [40, 32] is not a multiple of 16"),
        (deepseek, (256, 512), None, Fp8Gemms(True, False), "runs no block FP8 GEMM on cuda"),
        (QuantScheme("fp8", "block", (128, 128), "weight_scale_inv", "static"), (256, 512), None, BOTH,
         "activation scales are static"),
    ]
    for scheme, local, unaligned, gemms, why in reasons:
        recipe, got = choose("auto", CUDA, bf16, gemms, scheme, "w", local, unaligned)
        assert recipe is None and why in got, (why, got)
        with pytest.raises(QuantError, match="--fp8-compute fp8: .*use --fp8-compute auto"):
            choose("fp8", CUDA, bf16, gemms, scheme, "w", local, unaligned)
    with pytest.raises(QuantError, match="--fp8-compute 'on': choose one of auto, dequantize, fp8"):
        choose("on", CUDA, bf16, BOTH, deepseek, "w", (256, 512), None)


def test_scales_are_handed_in_the_layout_the_gemm_takes():
    """rowwise: [1, N] fp32 contiguous (scale_b of torch._scaled_mm); block: [N/128, KB] fp32 with KB padded with ones to
    a multiple of 4, whose transpose [KB, N/128] is scale_b of F.scaled_mm's BlockWise128x128."""
    s = torch.rand(6, 1)
    for given in (s, s[:, 0].to(torch.bfloat16)):
        got = prepare_scale(given, "rowwise", 6)
        assert got.shape == (1, 6) and got.is_contiguous() and got.dtype == torch.float32
        assert torch.equal(got[0], given.reshape(6).float())
    assert torch.equal(prepare_scale(torch.tensor(0.5), "rowwise", 4), torch.full((1, 4), 0.5))
    blocks = torch.rand(3, 5)
    got = prepare_scale(blocks, "block", 384)
    assert got.shape == (3, 8) and got.is_contiguous() and torch.equal(got[:, :5], blocks)
    assert torch.equal(got[:, 5:], torch.ones(3, 3)) and got.t().shape == (8, 3)
    assert prepare_scale(torch.rand(2, 4), "block", 256).shape == (2, 4)


def test_rowwise_fp8_gemm_runs_on_cpu_against_its_dequantized_operands():
    """torch._scaled_mm has a CPU kernel for row-wise scales: the layer's output equals float64 on the FP8 operands
    (the input quantized per row by amax / 448, the checkpoint's scheme), the bias added once, any leading shape."""
    g = torch.Generator().manual_seed(3)
    w, x, bias = torch.randn(48, 32, generator=g), torch.randn(2, 5, 32, generator=g), torch.randn(48, generator=g)
    q, scale, dq = quantize(w, "channel")
    layer = Fp8Linear(q, scale, "rowwise", bias)
    got = layer(x)                                                        # [2, 5, 48] fp32
    sx = x.double().abs().amax(-1, keepdim=True) / 448
    xq = (x.double() / sx).to(torch.float8_e4m3fn).double() * sx
    want = xq @ dq.t() + bias.double()
    assert got.shape == (2, 5, 48) and layer.calls == 1
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert layer(x[:, :0]).shape == (2, 0, 48)
    assert probe("cpu", torch.float32) == Fp8Gemms(rowwise=True, block=False)   # no block-scaled kernel on a CPU


def test_ue8m0_block_scales_are_powers_of_two_read_exactly(tmp_path):
    """DeepSeek-V3.1-style scale_fmt ue8m0: one byte a block (float8_e8m0fnu, a power of two), accepted only under
    that scale_fmt, and each element dequantized to fp8 * 2^e exactly."""
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(96, 64, generator=g) * 50).to(torch.float8_e4m3fn)
    exps = torch.randint(-8, 4, (3, 2), generator=g).double()
    save_file({"lin.weight": q, "lin.weight_scale_inv": torch.pow(2.0, exps).to(torch.float8_e8m0fnu)},
              tmp_path / "model.safetensors")
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "scale_fmt": "ue8m0"}
    ckpt = Checkpoint(tmp_path, scheme_of(qc))
    got = ckpt.read("lin.weight", Source(keys=[(-1, 0, "lin.weight")]), ParamShard(0), 1, 2)     # rows [48, 96)
    full = torch.pow(2.0, exps).repeat_interleave(32, 0).repeat_interleave(32, 1)               # [96, 64] float64
    assert torch.equal(got.double(), (q.double() * full)[48:])
    with pytest.raises(QuantError, match=r"scale lin.weight_scale_inv is stored as F8_E8M0; served: F32, BF16, F16"):
        Checkpoint(tmp_path, scheme_of({**qc, "scale_fmt": "float"}))


def test_weight_bytes_count_fp8_weights_at_one_byte():
    """What a loaded rank's weights hold: an Fp8Linear's weight one byte an element plus its fp32 scales, a float
    layer its dtype's size, a tied tensor once."""
    from torch import nn

    from logitserve.memory import weight_bytes

    q, scale, _ = quantize(torch.randn(64, 32), "channel")
    model = nn.Sequential(Fp8Linear(q, scale, "rowwise"), nn.Linear(32, 16, bias=False).to(torch.bfloat16))
    model.append(model[1])                                                   # the same layer twice: counted once
    assert weight_bytes(model) == 64 * 32 * 1 + 64 * 4 + 16 * 32 * 2
