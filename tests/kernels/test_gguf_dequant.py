"""The Rust GGUF block decoders against gguf-py's numpy `gguf.quants.dequantize`, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from ferrollm.exceptions import KernelError
from ferrollm.kernels.cpu.gguf import dequantize, dequantize_supported, embedding

Q = GGMLQuantizationType
# Enough blocks that torch's team splits them (the kernel keeps 2048 blocks per thread or more).
SHAPE = (64, 16384)
# Byte offsets of each block's f16 scales, which random bytes must not make infinite or NaN.
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _stored(array: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """``array`` as the file stores it: ``uint8`` rows of blocks."""
    if qtype == Q.F16:
        return array.astype(np.float16).view(np.uint8)
    return quants.quantize(array, qtype)


def _random_k_blocks(qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant super-blocks (gguf-py cannot quantize these) with scales in [2^-15, 2)."""
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    rows = rng.integers(0, 256, size=(SHAPE[0], SHAPE[1] // block_len, block_bytes), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        rows[..., at + 1] &= 0x3f  # sign 0, exponent below 16: finite and under 2
    return rows.reshape(SHAPE[0], -1)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_every_format_decodes_as_gguf_py_does(qtype):
    rng = np.random.default_rng(int(qtype))
    if qtype in K_SCALES:
        data = _random_k_blocks(qtype, rng)
    else:
        data = _stored(rng.standard_normal(SHAPE, dtype=np.float32), qtype)
    assert dequantize_supported(qtype)
    got = dequantize(np.ascontiguousarray(data), qtype, SHAPE)
    want = quants.dequantize(data, qtype)
    assert got.shape == SHAPE and got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy().view(np.uint32), want.view(np.uint32))


def test_bfloat16_output_is_the_float32_output_rounded():
    data = _random_k_blocks(Q.Q6_K, np.random.default_rng(0))
    f32 = dequantize(data, Q.Q6_K, SHAPE)
    assert torch.equal(dequantize(data, Q.Q6_K, SHAPE, torch.bfloat16), f32.to(torch.bfloat16))


def test_types_without_a_decoder_are_reported_and_refused():
    assert not dequantize_supported(Q.Q2_K) and not dequantize_supported(Q.F32)
    with pytest.raises(KernelError, match="GGML type 10 has no block decoder"):
        dequantize(np.zeros(84, np.uint8), Q.Q2_K, (256,))


def test_bytes_that_do_not_fill_the_shape_are_refused():
    with pytest.raises(KernelError, match="whole Q4_0 blocks of 18 bytes"):
        dequantize(np.zeros(19, np.uint8), Q.Q4_0, (32,))
    with pytest.raises(KernelError, match="`out` has 64 elements, the shape needs 32"):
        dequantize(np.zeros(18, np.uint8), Q.Q4_0, (64,))
    with pytest.raises(KernelError, match="C-contiguous uint8"):
        dequantize(np.zeros((2, 36), np.uint8)[:, :18], Q.Q4_0, (2, 32))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.BF16])
@pytest.mark.parametrize("count", [1, 200])  # a decode step's row; a prefill's, split over the team
def test_an_embedding_lookup_decodes_the_rows_asked_for(qtype, count):
    rng = np.random.default_rng(int(qtype) + count)
    data = _random_k_blocks(qtype, rng) if qtype in K_SCALES else _stored(
        rng.standard_normal(SHAPE, dtype=np.float32), qtype)
    # Rows 1.. of the file's table: a view that starts inside the mapping, as a shard's does.
    table = torch.from_numpy(np.ascontiguousarray(data))[1:]
    ids = torch.from_numpy(rng.integers(0, SHAPE[0] - 1, size=(count, 1)))
    got = embedding(table, qtype, ids, SHAPE[1])
    want = dequantize(data, qtype, SHAPE)[1:][ids.view(-1)]
    assert got.shape == (count, 1, SHAPE[1]) and torch.equal(got.view(count, -1), want)
    half = embedding(table, qtype, ids, SHAPE[1], torch.float16)
    assert half.dtype == torch.float16 and torch.equal(half, embedding(table, qtype, ids, SHAPE[1]).half())


def test_an_embedding_lookup_outside_the_table_is_refused():
    table = torch.from_numpy(_stored(np.ones((4, 32), np.float32), Q.Q8_0))
    with pytest.raises(KernelError, match=r"`ids`.*in 0\.\.4.*4"):
        embedding(table, Q.Q8_0, torch.tensor([4]), 32)
    with pytest.raises(KernelError, match="row_len"):
        embedding(table, Q.Q8_0, torch.tensor([0]), 16)
    with pytest.raises(KernelError, match="stride"):
        embedding(table.t(), Q.Q8_0, torch.tensor([0]), 32)
