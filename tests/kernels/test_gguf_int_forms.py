"""GGUF blocks as weight-only integers (`gguf_blocks`), the form the Triton kernels read them in on
a GPU: each type against the Rust dequantizer, fused layers of mixed types, the Triton form (in
the interpreter here) against the dequantized weight, and the sharded-state round trip.

Tolerances. The integer form's weight is the decoder's value for value (``torch.equal``, atol 0):
both take the same float32 products, each exact (an fp16 scale times a code or a 6/8-bit
sub-scale has at most 19 significant bits) or rounded once in the same order, and the same sums;
only a zero's sign may differ (Q4_0's ``(q - 8) d`` against ``q d - 8 d``). Products sum exact code
products in another order than ``x @ w.T`` and scale per tile: ``atol = 1e-5 * max|ref|``, as
tests/kernels/test_triton_quant.py allows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from helpers.gguf_files import quantized_blocks

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.layers.quantization import qweights as qw

Q = GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# A Q4_K_M file's attention: q and k Q4_K, v Q6_K; and the legacy types beside each other.
MIXED = {"k-quants": [(Q.Q4_K, 24), (Q.Q4_K, 8), (Q.Q6_K, 8)],
         "legacy": [(Q.Q4_0, 16), (Q.Q5_1, 8), (Q.Q8_0, 8)]}


def gguf_weight(qtype, rows: int, blocks_per_row: int, seed: int = 0) -> qw.GGUFWeight:
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    data = quantized_blocks(qtype, rows, blocks_per_row * block_len, 0.1, np.random.default_rng(seed))
    return qw.GGUFWeight(torch.from_numpy(data), int(qtype), blocks_per_row * block_len, block_len, block_bytes)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_type_as_integers_is_the_decoded_weight(qtype):
    w = gguf_weight(qtype, rows=7, blocks_per_row=3, seed=int(qtype))
    block_len = w.block_len
    # A row-parallel shard: the middle block of each row, a strided view of the file's bytes.
    for part in (w, w.narrow(1, block_len, block_len)):
        as_int = part.as_int()
        assert as_int.shape == part.shape and as_int.scales.dtype == torch.float32
        assert torch.equal(as_int.dequantize(), part.dequantize())
    # Decoded where the blocks are (on a GPU, the form uploads the file's bytes first): "meta"
    # stands in for the device here, where one CPU tensor in the decoding would be an error.
    on_meta = dataclasses.replace(w, data=w.data.to("meta")).as_int()
    assert all(t.device.type == "meta" for t in (on_meta.q, on_meta.scales))


def test_a_type_without_an_integer_form_is_named():
    w = qw.GGUFWeight(torch.zeros(2, 84, dtype=torch.uint8), int(Q.Q2_K), 256, 256, 84)
    with pytest.raises(CheckpointError, match="GGUF type Q2_K has no weight-only integer form"):
        w.as_int()


@pytest.mark.parametrize("mix", sorted(MIXED))
def test_fused_projections_of_different_types_join_in_the_widest_form(mix):
    parts = [gguf_weight(t, rows, 2, seed=i) for i, (t, rows) in enumerate(MIXED[mix])]
    joined = qw.cat([p.as_int() for p in parts])
    # Q6_K's 16-wide groups and 8-bit codes, or the legacy 8-bit ones in groups of 32.
    assert (joined.bits, joined.group_size) == ((8, 16) if mix == "k-quants" else (8, 32))
    assert torch.equal(joined.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_int_weights_of_other_widths_and_groups_join_too():
    """As compressed-tensors' config groups may quantize q/k and v apart (4-bit with zero points
    in groups of 64 beside symmetric 8-bit per row): one form, the same values."""
    torch.manual_seed(0)
    four = qw.IntWeight(torch.randint(0, 16, (8, 128), dtype=torch.uint8), torch.rand(8, 2), torch.randn(8, 2), 4, 64)
    eight = qw.IntWeight(torch.randint(-128, 128, (4, 128), dtype=torch.int8), torch.rand(4, 1), None, 8, 128)
    joined = qw.cat([four, eight])
    assert (joined.bits, joined.group_size, joined.q.dtype) == (8, 64, torch.int8)
    assert torch.equal(joined.dequantize(), torch.cat([four.dequantize(), eight.dequantize()]))
