"""Each quantized layout through both kernel families, the CPU's Rust kernels and the Triton
ones (in the interpreter here, on a GPU under ``-m gpu`` elsewhere), against the layout's own
dequantization: the forms pack, place and call them consistently."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.dynamic_int import quantize_int8_rows, quantize_rtn
from ferrollm.model_executor.layers.quantization.fp8 import quantize_fp8
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear

OUT, IN = 48, 128


def _weights() -> dict[str, qw.QuantizedWeight]:
    torch.manual_seed(0)
    w = torch.randn(OUT, IN) * 0.1
    per_row = quantize_rtn(w, 8, IN)
    return {"int4": quantize_rtn(w, 4, 32), "int8": quantize_rtn(w, 8, 64),
            "w8a8": quantize_int8_rows(w), "fp8": quantize_fp8(w),
            # One group per row, its scales a transposed [1, out] view (as GPTQ's group_size -1
            # loads them); and a static activation scale, which the Triton forms hold on the device.
            "int8-row": dataclasses.replace(per_row, scales=_column_view(per_row.scales),
                                            mins=None if per_row.mins is None else _column_view(per_row.mins)),
            "fp8-static": dataclasses.replace(quantize_fp8(w), input_quant="static", input_scale=0.05),
            "fp8-token": dataclasses.replace(quantize_fp8(w), input_quant="token"),
            "int4-f16": _symmetric_int4_f16_scales(),
            "int8-f16": _symmetric_int8_f16_scales()}


def _symmetric_int4_f16_scales(group: int = 32) -> qw.IntWeight:
    """Symmetric int4 (mins `-8 · scale`) with fp16 scales: Q4_0 blocks where the CPU runs them."""
    q = torch.randint(0, 16, (OUT, IN), dtype=torch.uint8)
    scales = (torch.rand(OUT, IN // group) * 0.02 + 0.005).half().float()
    return qw.IntWeight(q, scales, -8 * scales, 4, group)


def _symmetric_int8_f16_scales(group: int = 32) -> qw.IntWeight:
    """Symmetric int8 (no mins) with fp16 scales: Q8_0 blocks where the CPU runs them."""
    q = torch.randint(-128, 128, (OUT, IN), dtype=torch.int8)
    scales = (torch.rand(OUT, IN // group) * 0.002 + 0.0005).half().float()
    return qw.IntWeight(q, scales, None, 8, group)


def _column_view(t: torch.Tensor) -> torch.Tensor:
    """``[out, 1]`` as the transpose of a ``[1, out]`` tensor: strides ``(1, out)``."""
    return torch.empty(1, t.shape[0]).copy_(t.reshape(1, -1)).t()


def _backends():
    backends = ["cpu"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        backends.append("triton")
    return backends


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("kind", ["int4", "int4-f16", "int8", "int8-f16", "int8-row", "w8a8", "fp8", "fp8-static",
                                  "fp8-token"])
@pytest.mark.parametrize("rows", [1, 5])
def test_forms_multiply_like_their_dequantized_weight(kind, backend, rows):
    weight = _weights()[kind]
    form = QuantizedLinear(weight, torch.device("cpu"), backend=backend)
    x = torch.randn(rows, IN)
    bias = torch.randn(OUT)
    expected = x @ weight.dequantize().t() + bias
    # Weight-only kinds are exact to float32 rounding; the others round x first (int8: 1/254 of a
    # row's largest value per element; e4m3: 1/16 relative; the "-f16" kinds, Q4_0/Q8_0 blocks on
    # the CPU, two 8-bit parts: 1/254²), bounded here by the sum of |w| times that rounding.
    slack = {"int4": 1e-4, "int8": 1e-4, "int8-row": 1e-4}.get(kind)
    if slack is None:
        step = x.abs().amax() / {"w8a8": 254, "int4-f16": 254**2, "int8-f16": 254**2}.get(kind, 16)
        slack = float(step * weight.dequantize().abs().sum(1).max()) + 1e-4
    torch.testing.assert_close(form.linear(x, bias), expected, atol=slack, rtol=0)


@pytest.mark.parametrize("kind", ["int4", "int4-f16", "int8", "int8-f16", "w8a8", "fp8"])
def test_sharded_state_tensors_round_trip_through_the_cpu_packing(kind):
    """What save_sharded_state writes for a layer (read back from the kernels' packing) makes the
    same weight again (e2e/test_quantization.py round-trips whole models)."""
    from ferrollm.model_executor.layers.quantization.saved_state import _SavedMethod, saved_tensors

    weight = _weights()[kind]
    form = QuantizedLinear(weight, torch.device("cpu"))
    again = _SavedMethod().make(saved_tensors(form.saved_weight()))
    assert type(again) is type(weight)
    torch.testing.assert_close(again.dequantize(), weight.dequantize(), atol=0, rtol=0)


def test_a_gguf_form_re_laid_in_groups_saves_the_file_s_blocks():
    """Q4_0/Q8_0 segments are re-laid in 16-row groups where the CPU runs those (a Q5_0 beside
    them stays as the file holds it); what save_sharded_state reads back is the file's blocks."""
    from gguf import GGMLQuantizationType as Q, GGML_QUANT_SIZES, quants

    from ferrollm.kernels.cpu.gguf import InterleavedBlocks, gguf_linear_stacked, interleave_preferred

    rng = torch.Generator().manual_seed(0)
    parts = []
    for qtype, rows in ((Q.Q4_0, 40), (Q.Q8_0, 8), (Q.Q5_0, 8)):
        data = torch.from_numpy(quants.quantize((torch.randn(rows, 256, generator=rng) * 0.1).numpy(), qtype))
        parts.append(qw.GGUFWeight(data, int(qtype), 256, *GGML_QUANT_SIZES[qtype]))
    form = QuantizedLinear(parts, torch.device("cpu"))
    kinds = [isinstance(s, InterleavedBlocks) for s in form.segments]
    assert kinds == [interleave_preferred(Q.Q4_0), interleave_preferred(Q.Q8_0), False]
    saved = form.saved_weight()
    assert all(torch.equal(s.data, p.data) for s, p in zip(saved, parts))
    x = torch.randn(3, 256, generator=rng)
    plain = gguf_linear_stacked(x, [(p.data, p.ggml_type) for p in parts], 256)
    torch.testing.assert_close(form.linear(x, None), plain, rtol=1e-5, atol=1e-5)


def test_symmetric_integers_with_f16_scales_become_gguf_blocks_only_where_they_hold_them_exactly(monkeypatch):
    """`int_blocks.as_blocks`: Q4_0 / Q8_0 blocks whose values are the weight's, bit for bit, and
    the same weight back for saving; every weight they cannot hold exactly, or that the CPU would
    not run faster, keeps its form."""
    from ferrollm.kernels.cpu import gguf
    from ferrollm.model_executor.layers.quantization import int_blocks

    monkeypatch.setattr(gguf, "interleave_preferred", lambda ggml_type: True)
    four, eight = _symmetric_int4_f16_scales(group=64), _symmetric_int8_f16_scales(group=64)
    for weight, ggml_type in ((four, int_blocks.GGML_Q4_0), (eight, int_blocks.GGML_Q8_0)):
        blocks = int_blocks.as_blocks(weight)
        assert blocks is not None and blocks.ggml_type == ggml_type
        assert torch.equal(blocks.dequantize(), weight.dequantize())
        back = int_blocks.from_blocks(blocks, 64)
        assert torch.equal(back.q, weight.q) and torch.equal(back.scales, weight.scales)
        assert (back.mins is None) == (weight.mins is None)
        assert back.mins is None or torch.equal(back.mins, weight.mins)
    refused = {"fp32 scales": dataclasses.replace(four, scales=four.scales + 1e-6, mins=-8 * (four.scales + 1e-6)),
               "int4 zero points": dataclasses.replace(four, mins=four.mins + four.scales),
               "int8 mins": dataclasses.replace(eight, mins=eight.scales),
               "act order": dataclasses.replace(four, perm=torch.arange(IN)),
               "groups of 16": _symmetric_int4_f16_scales(group=16)}
    for what, w in refused.items():
        assert int_blocks.as_blocks(w) is None, what
    monkeypatch.setenv("FERROLLM_CPU_INT_BLOCKS", "0")
    assert int_blocks.as_blocks(four) is None
    monkeypatch.delenv("FERROLLM_CPU_INT_BLOCKS")
    monkeypatch.setattr(gguf, "interleave_preferred", lambda ggml_type: False)
    assert int_blocks.as_blocks(four) is None
