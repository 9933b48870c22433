"""`gguf_linear` (products from GGUF blocks in place) against `dequantize(...)` then `x @ w.T`.

Tolerance: the kernel rounds ``x`` to ``q * d`` with ``d = max|x_g| / 127`` per group ``g`` of the
weight's block length (32 elements; 256 for the K-quants), so each element moves by at most
``d / 2 = max|x_g| / 254``, and an output by at most ``Σ_g max|x_g| / 254 · Σ_{i in g} |w_i|``: a
bound computed per output element below, not a magic number. The integer sums are exact; float32
accumulation adds ``1e-5 · Σ|x||w|`` of slack.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ferrollm.exceptions import KernelError
from ferrollm.kernels.cpu.gguf import dequantize, gguf_linear, gguf_linear_stacked, gguf_linear_supported

Q = GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# gguf-py has no K-quant quantizer: random super-blocks, with these f16 scales kept finite.
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
IN_FEATURES = 512  # two K super-blocks, sixteen legacy blocks


def _blocks(qtype: GGMLQuantizationType, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """A weight as the file stores it: uint8 ``[out_features, row_bytes]``."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SCALES:
        return quants.quantize(rng.standard_normal((out_features, in_features), dtype=np.float32), qtype)
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, size=(out_features, in_features // block_len, block_bytes), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        rows[..., at + 1] &= 0x1f  # sign 0, exponent below 8: finite scales under 2^-7 · 2
    return rows.reshape(out_features, -1)


def _reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, group: int, steps: float = 254):
    """``x @ w.T + bias`` in float64 and the bound the rounding of ``x`` keeps within: each
    element within ``max|x_g| / steps`` (254 for 8 bits, 254**2 with the 8-bit residual)."""
    x64, w64 = x.double(), w.double()
    want = x64 @ w64.T + (0 if bias is None else bias.double())
    amax = x64.abs().unflatten(1, (-1, group)).amax(dim=2)  # [rows, groups]
    l1 = w64.abs().unflatten(1, (-1, group)).sum(dim=2)  # [out, groups]
    bound = (amax / steps) @ l1.T * (1 + 1e-5) + 1e-5 * (x64.abs() @ w64.abs().T) + 1e-6
    return want, bound


def _check(got: torch.Tensor, qtype, x, w, bias=None):
    want, bound = _reference(x, w, bias, GGML_QUANT_SIZES[qtype][0])
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error reaches {worst:.3f} of the bound"


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 33])
@pytest.mark.parametrize("qtype", TYPES)
def test_matches_dequantize_then_matmul(qtype, rows):
    out_features = 37  # odd, and enough rows that torch's team splits them
    data = _blocks(qtype, out_features, IN_FEATURES, int(qtype))
    w = dequantize(data, qtype, (out_features, IN_FEATURES))
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)) * 3
    assert gguf_linear_supported(qtype)
    _check(gguf_linear(x, torch.from_numpy(data), qtype, IN_FEATURES), qtype, x, w)


@pytest.mark.parametrize("rows", [1, 4, 9])
def test_stacked_weights_equal_their_separate_products(rows):
    # q, k, v as a Q4_K_M file mixes them: the stack is one call, the same numbers as three.
    parts = [(Q.Q4_K, 24), (Q.Q8_0, 8), (Q.Q6_K, 8)]
    weights = [(torch.from_numpy(_blocks(t, n, IN_FEATURES, i)), t) for i, (t, n) in enumerate(parts)]
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(9))
    separate = torch.cat([gguf_linear(x, w, t, IN_FEATURES) for w, t in weights], dim=1) + bias
    torch.testing.assert_close(gguf_linear_stacked(x, weights, IN_FEATURES, bias), separate, rtol=0, atol=1e-6)
    with pytest.raises(KernelError, match=r"`bias` must be float32 \[40\]"):
        gguf_linear_stacked(x, weights, IN_FEATURES, bias[:8])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q5_K, Q.Q6_K])
def test_row_strided_view_with_bias(qtype):
    # A tensor-parallel shard: the second half of each row's blocks, a view of the whole weight.
    out_features, whole = 5, 2 * IN_FEATURES
    data = _blocks(qtype, out_features, whole, 3)
    half = data.shape[1] // 2
    shard = torch.from_numpy(data)[:, half:]
    assert shard.stride(0) == 2 * half and not shard.is_contiguous()
    w = dequantize(np.ascontiguousarray(data[:, half:]), qtype, (out_features, IN_FEATURES))
    x = torch.randn(7, IN_FEATURES, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(1))
    _check(gguf_linear(x, shard, qtype, IN_FEATURES, bias), qtype, x, w, bias)
    _check(gguf_linear(x[:1], shard, qtype, IN_FEATURES, bias), qtype, x[:1], w, bias)


def test_one_output_feature_and_no_rows():
    data = _blocks(Q.Q4_1, 1, IN_FEATURES, 4)
    w = dequantize(data, Q.Q4_1, (1, IN_FEATURES))
    x = torch.randn(3, IN_FEATURES, generator=torch.Generator().manual_seed(2))
    _check(gguf_linear(x, torch.from_numpy(data), Q.Q4_1, IN_FEATURES), Q.Q4_1, x, w)
    assert gguf_linear(x[:0], torch.from_numpy(data), Q.Q4_1, IN_FEATURES).shape == (0, 1)


def test_types_and_shapes_that_do_not_fit_are_refused():
    data = torch.from_numpy(_blocks(Q.Q4_0, 2, 64, 5))
    x = torch.zeros(1, 64)
    assert not gguf_linear_supported(Q.F16) and not gguf_linear_supported(Q.Q2_K)
    with pytest.raises(KernelError, match="`ggml_type` must be one of"):
        gguf_linear(x, data, Q.F16, 64)
    with pytest.raises(KernelError, match="`in_features` must be a multiple of 32. Given: 48"):
        gguf_linear(torch.zeros(1, 48), data, Q.Q4_0, 48)
    with pytest.raises(KernelError, match=r"`weight` must be uint8 \[out_features, 36\]"):
        gguf_linear(x, data[:, :30], Q.Q4_0, 64)
    with pytest.raises(KernelError, match=r"`x` must be float32 \[rows, 64\]"):
        gguf_linear(x.double(), data, Q.Q4_0, 64)
    with pytest.raises(KernelError, match=r"`bias` must be float32 \[2\]"):
        gguf_linear(x, data, Q.Q4_0, 64, torch.zeros(3))


@pytest.mark.parametrize("rows", [1, 3, 33])
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_interleaved_groups_match_dequantize_then_matmul_and_give_the_blocks_back(qtype, rows):
    # 37 rows: two whole groups of 16 and a padded one; stacked beside a file-layout weight.
    from ferrollm.kernels.cpu.gguf import deinterleave, interleave

    data = _blocks(qtype, 37, IN_FEATURES, 3)
    other = _blocks(Q.Q6_K, 5, IN_FEATURES, 4)
    blocks = interleave(torch.from_numpy(data), qtype, IN_FEATURES)
    assert blocks.data.numel() == 48 * data.shape[1]  # the file's bytes, padded to whole groups
    assert torch.equal(deinterleave(blocks, IN_FEATURES), torch.from_numpy(data))
    w = torch.cat([dequantize(data, qtype, (37, IN_FEATURES)), dequantize(other, Q.Q6_K, (5, IN_FEATURES))])
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(42)
    got = gguf_linear_stacked(x, [blocks, (torch.from_numpy(other), Q.Q6_K)], IN_FEATURES, bias)
    want, bound = _reference(x, w, bias, 32)
    assert ((got.double() - want).abs() / bound).max().item() <= 1.0
    with pytest.raises(KernelError, match="Q4_0, Q4_1 or Q8_0"):
        interleave(torch.from_numpy(other), Q.Q6_K, IN_FEATURES)


@pytest.mark.parametrize("rows", [1, 3, 33])
def test_residual_activations_bring_the_bound_down_by_254(rows):
    # The LM head's product: 8-bit values and their 8-bit residual, pairs in one tile, one read
    # of the weight; interleaved Q8_0 beside a Q6_K in the file's layout.
    from ferrollm.kernels.cpu.gguf import interleave, interleave_preferred

    data, other = _blocks(Q.Q8_0, 37, IN_FEATURES, 5), _blocks(Q.Q6_K, 5, IN_FEATURES, 6)
    first = interleave(torch.from_numpy(data), Q.Q8_0, IN_FEATURES) if interleave_preferred(Q.Q8_0) \
        else (torch.from_numpy(data), Q.Q8_0)
    w = torch.cat([dequantize(data, Q.Q8_0, (37, IN_FEATURES)), dequantize(other, Q.Q6_K, (5, IN_FEATURES))])
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(rows)) * 3
    bias = torch.randn(42)
    weights = [first, (torch.from_numpy(other), Q.Q6_K)]
    got = gguf_linear_stacked(x, weights, IN_FEATURES, bias, residual=True)
    want, bound = _reference(x, w, bias, 32, steps=254**2)
    assert ((got.double() - want).abs() / bound).max().item() <= 1.0
    # Without the residual the error is of the 8-bit bound's order, far past this one.
    plain = gguf_linear_stacked(x, weights, IN_FEATURES, bias)
    assert ((plain.double() - want).abs() / bound).max().item() > 10
