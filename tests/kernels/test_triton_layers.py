"""The Triton RMSNorm, rotary and SiLU-and-mul kernels, run by Triton's interpreter on the CPU,
against their torch references and the model layers they stand in for."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must come before ferrollm.kernels.triton)
import pytest
import torch

from ferrollm.kernels.triton import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)
from ferrollm.model_executor.layers.activation import SiluAndMul
from ferrollm.model_executor.layers.norm import RMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.bfloat16]
# float32 sums in another order; bfloat16 results are bit-identical unless such a difference
# crosses a rounding boundary, which these seeds do not hit.
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=0, rtol=0)}


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 48])
def test_rms_norm_matches_the_layer(dtype, hidden_size):
    x = randn(3, 5, hidden_size, dtype=dtype) * 3
    layer = RMSNorm(hidden_size, eps=1e-5, params_dtype=dtype)
    layer.weight.data.copy_(randn(hidden_size, dtype=dtype, seed=1))
    out = rms_norm(x, layer.weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, layer.weight, 1e-5), **TOL[dtype])
    # The reference is the layer's torch path, bit for bit (on the CPU the layer itself runs the
    # Rust kernel, which sums in another order).
    torch.testing.assert_close(rms_norm_ref(x, layer.weight, 1e-5), layer._normalize(x), atol=0, rtol=0)
    torch.testing.assert_close(layer(x), layer._normalize(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_updates_both_in_place_like_the_layer(dtype):
    x, residual = randn(7, 40, dtype=dtype), randn(7, 40, dtype=dtype, seed=1)
    weight = randn(40, dtype=dtype, seed=2)
    layer = RMSNorm(40, eps=1e-6, params_dtype=dtype)
    layer.weight.data.copy_(weight)
    want_residual = x + residual
    want_out = layer._normalize(want_residual)  # the torch path (see above)
    x_ref, r_ref = fused_add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(x_ref, want_out, atol=0, rtol=0)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert out is x and new_residual is residual
    assert torch.equal(residual, want_residual)  # a rounded add, bit for bit
    torch.testing.assert_close(x, want_out, **TOL[dtype])


def test_rms_norm_rows_of_a_strided_view():
    base = randn(6, 96)
    x = base[:, :64]  # rows 96 apart
    weight = randn(64, seed=1)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox,rotary_dim", [(True, 16), (True, 8), (False, 16), (False, 12)])
def test_rotary_embedding_in_place(dtype, neox, rotary_dim):
    head_size, num_tokens = 16, 9
    rope = RotaryEmbedding(head_size, rotary_dim, max_position=64, base=10000.0, is_neox_style=neox, dtype=dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(0))
    query = randn(num_tokens, 6 * head_size, dtype=dtype, seed=1)
    key = randn(num_tokens, 2, head_size, dtype=dtype, seed=2)
    q_ref, k_ref = query.clone(), key.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, head_size, rope.cos_sin_cache, neox)
    layer_q, layer_k = rope(positions, query, key.view(num_tokens, -1))

    rotary_embedding(positions, query, key, head_size, rope.cos_sin_cache, neox)
    torch.testing.assert_close(query, q_ref, **TOL[dtype])
    torch.testing.assert_close(key, k_ref, **TOL[dtype])
    # The layer rounds after each product in bf16; the kernel rounds once.
    layer_tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(query, layer_q, **layer_tol)
    torch.testing.assert_close(key.view(num_tokens, -1), layer_k, **layer_tol)
    # Features past rotary_dim are untouched.
    assert torch.equal(key[..., rotary_dim:], k_ref[..., rotary_dim:])


def test_rotary_embedding_on_slices_of_a_fused_qkv():
    head_size, num_tokens = 8, 5
    rope = RotaryEmbedding(head_size, head_size, max_position=32, base=500.0)
    qkv = randn(num_tokens, (4 + 2 + 2) * head_size)
    expected = qkv.clone()
    positions = torch.arange(3, 3 + num_tokens)
    q, k = qkv[:, :32], qkv[:, 32:48]
    rotary_embedding(positions, q, k, head_size, rope.cos_sin_cache)
    rotary_embedding_ref(positions, expected[:, :32], expected[:, 32:48], head_size, rope.cos_sin_cache)
    torch.testing.assert_close(qkv, expected)
    assert torch.equal(qkv[:, 48:], expected[:, 48:])  # values untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [1024, 16])
def test_silu_and_mul_matches_the_layer(dtype, block):
    x = randn(2, 3, 2 * 40, dtype=dtype) * 4
    out = silu_and_mul(x, block=block)
    assert out.shape == (2, 3, 40) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])
    # The layer's CPU path is the Rust kernel (its own exp), close to the reference, not bit-equal.
    torch.testing.assert_close(SiluAndMul()(x), silu_and_mul_ref(x), **TOL[dtype])


def test_bad_shapes_are_errors_naming_the_argument():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(randn(2, 8), randn(6), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(randn(2, 8), randn(2, 8, dtype=torch.bfloat16), randn(8), 1e-6)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(torch.arange(2), randn(2, 8), randn(2, 8), 8, randn(10, 9))
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(randn(2, 7))
