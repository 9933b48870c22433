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
from ferrollm.kernels.cpu.quant import pack_int4, wq_linear

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
