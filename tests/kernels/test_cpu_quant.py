"""The quantized CPU linear layers (``ferrollm.kernels.cpu.quant``) against torch: the weight
dequantized from the same stored values, then a float64 matmul.

Shapes are odd on purpose: 37 output features (a multiple of nothing the kernels tile by), row
counts on both sides of the two-row streaming path and of the 4-row micro-kernel, and every group
layout the kernels take: 16 (with an odd number of groups), 32 to 256, and per channel with an
``in_features`` that is not a multiple of 32. The tolerance is float32 accumulation's: a few
units of 1e-6 of ``|x| @ |w|.T``, the sum of the magnitudes the result is made of.
"""

from __future__ import annotations

import pytest
import torch
from ferrollm.exceptions import KernelError
from ferrollm.kernels.cpu.quant import (
    fp8_linear,
    pack_int4,
    w8a8_linear,
    w8a8_pack,
    wq_linear,
)

ROWS = (1, 2, 3, 7, 33, 130)
OUT_FEATURES = 37
LAYOUTS = [(64, 16), (48, 16), (96, 32), (128, 64), (384, 128), (512, 256), (37, 37), (160, 160)]


def _assert_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = x.double() @ w.double().T
    if bias is not None:
        want += bias.double()
    bound = 4e-6 * (x.double().abs() @ w.double().abs().T) + 1e-6
    err = (got.double() - want).abs()
    worst = (err / bound).max().item()
    assert worst <= 1, f"worst error {worst:.2f}x the tolerance"


def _weight_only(bits: int, in_features: int, group_size: int, asym: bool, gen: torch.Generator):
    """Stored values, scales, mins and the dequantized weight they stand for."""
    shape = (OUT_FEATURES, in_features)
    if bits == 4:
        q = torch.randint(0, 16, shape, dtype=torch.uint8, generator=gen)
    else:
        q = torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen)
    groups = in_features // group_size
    scales = torch.rand(OUT_FEATURES, groups, generator=gen) * 0.02 + 1e-3
    mins = torch.randn(OUT_FEATURES, groups, generator=gen) * 0.05 if asym else None
    w = q.float() * scales.repeat_interleave(group_size, 1)
    if mins is not None:
        w += mins.repeat_interleave(group_size, 1)
    return q, scales, mins, w


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("in_features", "group_size"), LAYOUTS)
@pytest.mark.parametrize("asym", [False, True], ids=["sym", "mins"])
def test_weight_only_matches_dequantize_then_matmul(bits, in_features, group_size, asym):
    gen = torch.Generator().manual_seed(bits * 1000 + in_features + group_size + asym)
    q, scales, mins, w = _weight_only(bits, in_features, group_size, asym, gen)
    qweight = pack_int4(q) if bits == 4 else q
    bias = torch.randn(OUT_FEATURES, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        for b in (None, bias):
            got = wq_linear(x, qweight, scales, mins, bits, group_size, b)
            assert got.shape == (rows, OUT_FEATURES) and got.dtype == torch.float32
            _assert_matches(got, x, w, b)


def test_leading_dimensions_are_kept():
    gen = torch.Generator().manual_seed(0)
    q, scales, mins, w = _weight_only(8, 64, 32, True, gen)
    x = torch.randn(2, 3, 64, generator=gen)
    got = wq_linear(x, q, scales, mins, 8, 32)
    assert got.shape == (2, 3, OUT_FEATURES)
    _assert_matches(got.view(6, -1), x.view(6, -1), w, None)


def test_int4_packs_two_elements_per_byte_in_blocks_of_32():
    q = (torch.arange(2 * 40) % 16).to(torch.uint8).view(2, 40)
    packed = pack_int4(q)
    assert packed.shape == (2, 32) and packed.dtype == torch.uint8
    assert packed[1, 0] == q[1, 0] | (q[1, 16] << 4)
    assert packed[0, 16 + 7] == q[0, 39]  # the second block holds 32..39, its high nibbles padding
    assert torch.all(packed[:, 16 + 8:] == 0)


def test_refusals_name_the_parameter_and_the_limit():
    gen = torch.Generator().manual_seed(1)
    q, scales, _, _ = _weight_only(8, 96, 32, False, gen)
    x = torch.randn(1, 96)
    with pytest.raises(KernelError, match=r"`group_size` must be a divisor of in_features \(96\). Given: 40"):
        wq_linear(x, q, torch.rand(OUT_FEATURES, 2), None, 8, 40)
    with pytest.raises(KernelError, match=r"`group_size` must be 16, a multiple of 32, or in_features \(96\). Given: 48"):
        wq_linear(x, q, torch.rand(OUT_FEATURES, 2), None, 8, 48)
    with pytest.raises(KernelError, match="`scales` has 74 elements, the shape needs 111"):
        wq_linear(x, q, torch.rand(OUT_FEATURES, 2), None, 8, 32)
    with pytest.raises(KernelError, match="`qweight` must be a contiguous CPU torch.int8 tensor"):
        wq_linear(x, q.to(torch.uint8), scales, None, 8, 32)
    with pytest.raises(KernelError, match="`bits` must be 4 or 8. Given: 3"):
        wq_linear(x, q, scales, None, 3, 32)
    with pytest.raises(KernelError, match="`q` must be between 0 and 15. Given: 16"):
        pack_int4(torch.full((2, 8), 16, dtype=torch.uint8))


def _int8_activations(x: torch.Tensor, input_scale: float | None, zero_point: int):
    """vLLM's ``scaled_int8_quant``: per row ``s = max|x| / 127`` (dynamic) or the given scale,
    ``q = clamp(round(x / s) + zp, -128, 127)``, ties to even (``torch.round``)."""
    if input_scale is None:
        scale = x.abs().amax(dim=1, keepdim=True) / 127
        q = torch.where(scale > 0, torch.round(x / scale), torch.zeros_like(x)).clamp(-128, 127)
        return q, scale, 0
    scale = torch.full((x.shape[0], 1), input_scale)
    return (torch.round(x / scale) + zero_point).clamp(-128, 127), scale, zero_point


@pytest.mark.parametrize("in_features", [64, 37, 896])
@pytest.mark.parametrize(("input_scale", "zero_point"), [(None, 0), (0.02, 0), (0.01, -7)],
                         ids=["dynamic", "static", "static-asym"])
def test_w8a8_matches_the_integer_definition(in_features, input_scale, zero_point):
    gen = torch.Generator().manual_seed(in_features + (zero_point or 0))
    qweight = torch.randint(-128, 128, (OUT_FEATURES, in_features), dtype=torch.int8, generator=gen)
    weight_scale = torch.rand(OUT_FEATURES, generator=gen) * 0.01
    bias = torch.randn(OUT_FEATURES, generator=gen)
    packed = w8a8_pack(qweight)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        x[0] = 0  # a row of zeros quantizes to zeros (dynamic scale 0)
        for b in (None, bias):
            got = w8a8_linear(x, packed, weight_scale, b, input_scale, zero_point)
            q, s, zp = _int8_activations(x, input_scale, zero_point)
            dots = ((q - zp).double() @ qweight.double().T).float()
            want = (s * weight_scale) * dots + (0 if b is None else b)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_w8a8_takes_column_scales_and_tensor_settings():
    gen = torch.Generator().manual_seed(5)
    qweight = torch.randint(-128, 128, (OUT_FEATURES, 64), dtype=torch.int8, generator=gen)
    weight_scale = torch.rand(OUT_FEATURES, 1, generator=gen)
    x = torch.randn(2, 3, 64, generator=gen)
    packed = w8a8_pack(qweight)
    got = w8a8_linear(x, packed, weight_scale, None, torch.tensor([0.05]), torch.tensor(2))
    assert got.shape == (2, 3, OUT_FEATURES)
    assert torch.equal(got, w8a8_linear(x, packed, weight_scale.view(-1), None, 0.05, 2))
    with pytest.raises(KernelError, match="`input_scale` must be finite and > 0. Given: 0"):
        w8a8_linear(x, packed, weight_scale, None, 0.0)
    with pytest.raises(KernelError, match="`input_zero_point` must be between -128 and 127. Given: 128"):
        w8a8_linear(x, packed, weight_scale, None, 0.1, 128)
    with pytest.raises(KernelError, match="`packed` must have shape"):
        w8a8_linear(torch.randn(1, 60), packed, weight_scale)


FP8 = torch.float8_e4m3fn


def _fp8_weight(in_features: int, kind: str, gen: torch.Generator):
    """An e4m3 weight, its scale of ``kind`` ('tensor', 'channel', 'block' of 16 x 32), the
    block size, and the dequantized float32 weight."""
    w8 = (torch.randn(OUT_FEATURES, in_features, generator=gen) * 40).clamp(-448, 448).to(FP8)
    if kind == "tensor":
        scale, block, full = torch.tensor(0.01), None, torch.tensor(0.01)
    elif kind == "channel":
        scale = torch.rand(OUT_FEATURES, 1, generator=gen) * 0.01
        block, full = None, scale
    else:
        block = (16, 32)
        scale = torch.rand(-(-OUT_FEATURES // 16), -(-in_features // 32), generator=gen) * 0.01
        full = scale.repeat_interleave(16, 0)[:OUT_FEATURES].repeat_interleave(32, 1)[:, :in_features]
    return w8, scale, block, w8.float() * full


def _fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` saturated and cast to e4m3 (ties to even), as vLLM's fp8 quantization."""
    return (x / scale).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("in_features", [64, 100, 896])
@pytest.mark.parametrize("kind", ["tensor", "channel", "block"])
@pytest.mark.parametrize("input_quant", ["none", "tensor", "static", "group"])
def test_fp8_matches_the_dequantized_operands(in_features, kind, input_quant):
    if input_quant == "group" and kind != "block":
        pytest.skip("per-group activations go with block weights")
    gen = torch.Generator().manual_seed(in_features + len(kind) + len(input_quant))
    w8, scale, block, w = _fp8_weight(in_features, kind, gen)
    bias = torch.randn(OUT_FEATURES, generator=gen)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        static = 0.02
        if input_quant == "none":
            xq = x
        elif input_quant == "group":
            groups = x.split(32, dim=1)
            xq = torch.cat([_fp8_round(g, g.abs().amax(1, keepdim=True) / 448).float()
                            * (g.abs().amax(1, keepdim=True) / 448) for g in groups], dim=1)
        else:
            s = x.abs().max() / 448 if input_quant == "tensor" else torch.tensor(static)
            xq = _fp8_round(x, s).float() * s
        got = fp8_linear(x, w8, scale, bias, block, input_quant, static if input_quant == "static" else None)
        _assert_matches(got, xq, w, bias)


def test_fp8_per_tensor_agrees_with_torch_scaled_mm():
    gen = torch.Generator().manual_seed(3)
    w8, scale, _, _ = _fp8_weight(256, "tensor", gen)
    x = torch.randn(33, 256, generator=gen)
    s_x = x.abs().max() / 448
    want = torch._scaled_mm(_fp8_round(x, s_x), w8.t(), scale_a=s_x.float(), scale_b=scale.float(),
                            out_dtype=torch.float32)
    got = fp8_linear(x, w8.view(torch.uint8), scale.view(1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_fp8_nan_encodings_decode_to_nan():
    w8 = torch.zeros(3, 64, dtype=torch.uint8)
    w8[1, 5], w8[2, 40] = 0x7F, 0xFF
    for rows in (1, 5):
        got = fp8_linear(torch.ones(rows, 64), w8, torch.tensor(1.0), input_quant="none")
        assert torch.equal(got.isnan(), torch.tensor([[False, True, True]] * rows))


def test_fp8_refusals():
    w8 = torch.zeros(OUT_FEATURES, 64, dtype=torch.uint8)
    x = torch.randn(2, 64)
    with pytest.raises(KernelError, match="needs block_size"):
        fp8_linear(x, w8, torch.tensor(1.0), input_quant="group")
    with pytest.raises(KernelError, match="`input_scale` must be given"):
        fp8_linear(x, w8, torch.tensor(1.0), input_quant="static")
    with pytest.raises(KernelError, match=r"`block_size` must be .* bi a multiple of 16. Given: \(1, 8\)"):
        fp8_linear(x, w8, torch.ones(OUT_FEATURES, 8), block_size=(1, 8))
    with pytest.raises(KernelError, match="`weight_scale` has 2 elements, the shape needs 37"):
        fp8_linear(x, w8, torch.ones(2))
