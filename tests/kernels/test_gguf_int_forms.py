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
import logging
import os

import helpers.triton_interpret  # noqa: F401  (must come before ferrollm.kernels.triton)
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from helpers.gguf_files import quantized_blocks

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear
from ferrollm.model_executor.layers.quantization.gguf import GGUFConfig
from ferrollm.model_executor.layers.quantization.saved_state import _SavedMethod, saved_tensors

Q = GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# A Q4_K_M file's attention: q and k Q4_K, v Q6_K; and the legacy types beside each other.
MIXED = {"k-quants": [(Q.Q4_K, 24), (Q.Q4_K, 8), (Q.Q6_K, 8)],
         "legacy": [(Q.Q4_0, 16), (Q.Q5_1, 8), (Q.Q8_0, 8)]}
BACKENDS = ["cpu"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])


def gguf_weight(qtype, rows: int, blocks_per_row: int, seed: int = 0) -> qw.GGUFWeight:
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    data = quantized_blocks(qtype, rows, blocks_per_row * block_len, 0.1, np.random.default_rng(seed))
    return qw.GGUFWeight(torch.from_numpy(data), int(qtype), blocks_per_row * block_len, block_len, block_bytes)


def assert_product_close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * want.abs().max().item())


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


def form_parts(kind: str) -> list[qw.GGUFWeight]:
    """One type's weight, or a mixed fused layer's, 256 or 64 inputs wide (short interpreter runs)."""
    spec = MIXED.get(kind) or [(Q[kind], 12)]
    blocks = 1 if GGML_QUANT_SIZES[spec[0][0]][0] == 256 else 2
    return [gguf_weight(t, rows, blocks, seed=i) for i, (t, rows) in enumerate(spec)]


def check_form_product(form: QuantizedLinear, parts: list[qw.GGUFWeight]) -> None:
    weight = torch.cat([p.dequantize() for p in parts])
    bias = torch.randn(weight.shape[0])
    for rows in (1, 5):
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        got = form.linear(x.to(form.device), bias.to(form.device)).cpu()
        assert_product_close(got, x @ weight.t() + bias)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", [t.name for t in TYPES] + sorted(MIXED))
def test_the_form_multiplies_like_the_dequantized_weight(kind, backend):
    """The Triton form reads the blocks as integers; the CPU form reads the blocks themselves
    (its 8-bit activations are tests/kernels/test_gguf_linear.py's business, so only the Triton
    one is compared here)."""
    parts = form_parts(kind)
    form = QuantizedLinear(parts, torch.device("cpu"), backend=backend)
    assert form.kind == ("gguf" if backend == "cpu" else _triton_kind(kind))
    if backend == "triton":
        assert form.gguf_file_bytes == sum(p.data.numel() for p in parts)
        check_form_product(form, parts)


def _triton_kind(kind: str) -> str:
    """One weight for a single type; a mixed fused layer keeps one part per run of alike
    projections, so no rows are widened."""
    return "parts" if kind in MIXED else "IntWeight"


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs TRITON_INTERPRET=1 (the Triton form on CPU tensors)")
def test_a_mixed_fused_layer_keeps_each_run_in_its_own_form():
    """A Q4_K_M attention (q, k Q4_K; v Q6_K): q and k join as 4-bit codes in groups of 32, v
    stays 8-bit in groups of 16, and the layer holds less than the widest form for every row."""
    parts = form_parts("k-quants")
    form = QuantizedLinear(parts, torch.device("cpu"), backend="triton")
    assert [(p.source.bits, p.source.group_size, p.out_features) for p in form.parts] == [(4, 32, 32), (8, 16, 8)]
    widest = QuantizedLinear(qw.cat([p.as_int() for p in parts]), torch.device("cpu"), backend="triton")
    assert sum(form.tensors().values()) < sum(widest.tensors().values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="needs a CUDA device and TRITON_INTERPRET=0")
@pytest.mark.parametrize("kind", [t.name for t in TYPES] + sorted(MIXED))
def test_gpu_form_multiplies_like_the_dequantized_weight(kind):
    """Compiled on the device (float32 activations take IEEE products there, as here)."""
    parts = form_parts(kind)
    form = QuantizedLinear(parts, torch.device("cuda"))
    assert form.kind == _triton_kind(kind)
    assert all(p.packed.is_cuda for p in getattr(form, "parts", [form]))
    check_form_product(form, parts)


@pytest.mark.skipif("triton" not in BACKENDS, reason="needs TRITON_INTERPRET=1 (the Triton form on CPU tensors)")
def test_a_sharded_triton_form_round_trips_through_sharded_state():
    """Sharded before the conversion (a row-parallel rank's second half of the columns), saved
    from the Triton form and loaded back: the same weight, on either kernel family."""
    parts = [gguf_weight(t, rows, 2, seed=i).narrow(1, 256, 256) for i, (t, rows) in enumerate(MIXED["k-quants"])]
    form = QuantizedLinear(parts, torch.device("cpu"), backend="triton")
    again = _SavedMethod().make(saved_tensors(form.saved_weight()))
    weight = torch.cat([p.dequantize() for p in parts])
    assert isinstance(again, qw.IntWeight) and torch.equal(again.dequantize(), weight)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for backend in ("triton", "cpu"):
        assert_product_close(QuantizedLinear(again, torch.device("cpu"), backend=backend).linear(x, None), x @ weight.t())


def test_a_gpu_keeps_the_projections_and_the_vocabulary(caplog):
    layer = "model.layers.0"
    types = {"model.embed_tokens.weight": int(Q.Q8_0), "lm_head.weight": int(Q.Q6_K),
             f"{layer}.self_attn.q_proj.weight": int(Q.Q4_K), f"{layer}.self_attn.k_proj.weight": int(Q.Q4_K),
             f"{layer}.self_attn.v_proj.weight": int(Q.Q6_K), f"{layer}.self_attn.o_proj.weight": int(Q.Q5_0),
             f"{layer}.mlp.gate_proj.weight": int(Q.Q2_K), f"{layer}.mlp.up_proj.weight": int(Q.Q4_K)}
    config = GGUFConfig()
    config.fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        config.bind(types, torch.device("cuda"))
    kept = {n for n in types if config.keeps(n)}
    # up_proj is fused with a Q2_K gate_proj, which has no integer form: both are dequantized.
    tables = {"model.embed_tokens.weight", "lm_head.weight"}
    assert kept == {f"{layer}.self_attn.{p}_proj.weight" for p in "qkvo"} | tables
    assert "Q4_K 4.5 -> 6, Q5_0 5.5 -> 9, Q6_K 6.56 -> 10, Q8_0 8.5 -> 9" in caplog.text.replace("'", "")
    assert "dequantized or converted to the run dtype at load: [Q2_K, Q4_K]" in caplog.text.replace("'", "")
    config.bind(types, torch.device("cpu"))  # the same on the CPU, where the tables stay blocks
    assert {n for n in types if config.keeps(n)} == kept
    config.bind({**types, "lm_head.weight": int(Q.Q2_K)}, torch.device("cuda"))
    assert not config.keeps("lm_head.weight")  # dequantized, as any type without an integer form


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_vocabulary_table_as_integers_looks_its_rows_up_as_decoded(qtype):
    """The embedding of a GGUF table kept as integers off the CPU: the rows of the decoded table,
    value for value, in the shape of the ids."""
    table = gguf_weight(qtype, rows=9, blocks_per_row=1 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 3, seed=3)
    form = QuantizedLinear([table], torch.device("cpu"), backend="triton")
    ids = torch.tensor([[4, 0, 8], [4, 4, 1]])
    got = form.rows(ids)
    assert got.shape == (2, 3, table.in_features) and got.dtype == torch.float32
    assert torch.equal(got, table.dequantize()[ids])


def test_rows_are_read_only_from_the_triton_integer_form():
    form = QuantizedLinear([gguf_weight(Q.Q8_0, 4, 1)], torch.device("cpu"), backend="cpu")
    with pytest.raises(TypeError, match="weight-only integer form for the Triton kernels, not gguf"):
        form.rows(torch.tensor([0]))
