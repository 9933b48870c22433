"""The CPU matmul path (`cpu_gemm`): packed weights (ferrollm's GEMM panels in fp32 on AVX-512,
oneDNN's layout otherwise) give F.linear's result in fp32 and bf16."""

import pytest
import torch
import torch.nn.functional as F

from ferrollm import _core, cpu_kernels
from ferrollm.exceptions import KernelError
from ferrollm.model_executor.layers.cpu_gemm import (
    MLP_SLAB_ROWS,
    PackedWeight,
    linear,
    onednn_enabled,
    row_slabs,
)
from ferrollm.model_executor.models.llama import LlamaMLP

BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
OWN_GEMM = cpu_kernels.gemm_supported(torch.empty(1, 1))
needs_own_gemm = pytest.mark.skipif(not OWN_GEMM, reason="no AVX-512 or no OpenMP team to join")


def _case(dtype: torch.dtype, rows: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_fp32_linear_matches_f_linear(rows, with_bias):
    x, weight, bias = _case(torch.float32, rows, with_bias)
    out = linear(x, weight, bias, PackedWeight(weight, bias))
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_linear_matches_float32_arithmetic(rows, with_bias):
    x, weight, bias = _case(torch.bfloat16, rows, with_bias)
    out = linear(x, weight, bias, PackedWeight(weight, bias))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    # Same bf16 operands, accumulated in fp32: the only difference is the output's bf16 rounding.
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=2e-2)


def test_onednn_is_used_for_fp32_and_for_bf16_only_where_onednn_runs_it(monkeypatch):
    cpu = torch.device("cpu")
    mkldnn = torch.backends.mkldnn.is_available()
    assert onednn_enabled(cpu, torch.float32) == mkldnn
    assert onednn_enabled(cpu, torch.bfloat16) == BF16_ONEDNN
    assert not onednn_enabled(cpu, torch.float16)
    assert not onednn_enabled(torch.device("meta"), torch.float32)
    monkeypatch.setenv("FERROLLM_CPU_ONEDNN", "0")
    assert not onednn_enabled(cpu, torch.float32) and not onednn_enabled(cpu, torch.bfloat16)


def test_a_mismatched_input_dtype_falls_back_to_f_linear():
    x, weight, bias = _case(torch.float32, 4, True)
    packed = PackedWeight(weight, bias) if torch.backends.mkldnn.is_available() else None
    out = linear(x.double(), weight.double(), bias.double(), packed)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, F.linear(x.double(), weight.double(), bias.double()))


@pytest.mark.parametrize("rows", [1, 7, 8, 20])
def test_row_slabs_gives_the_whole_product_and_calls_fn_per_slab(rows):
    x, _, _ = _case(torch.float32, rows, False)
    mix = torch.randn(96, 96, generator=torch.Generator().manual_seed(1))
    fn_calls = []

    def fn(part):
        fn_calls.append(part.shape[0])
        return torch.tanh(part @ mix) + part

    out = row_slabs(fn, x, 8)
    torch.testing.assert_close(out, fn(x))
    assert fn_calls[:-1] == [min(8, rows - start) for start in range(0, rows, 8)]


def test_the_cpu_mlp_of_a_long_prefill_runs_in_slabs_and_matches_one_pass():
    torch.manual_seed(0)
    mlp = LlamaMLP(32, 48, "silu", False, torch.float32)
    for param in mlp.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(MLP_SLAB_ROWS * 2 + 5, 32)
    torch.testing.assert_close(mlp(x), mlp._mlp(x), rtol=1e-5, atol=1e-5)


@needs_own_gemm
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 257, 300])
@pytest.mark.parametrize("shape", [(40, 96), (100, 129), (1153, 896), (896, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_own_fp32_gemm_matches_f_linear(rows, shape, with_bias):
    # One row (its own loop), rows around the 8-row block and past the 256-row slab (257 leaves
    # a one-row slab); columns that end mid-vector and mid-panel; k past the 128-row chunk and
    # not a multiple of it. Two threads split the columns.
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, shape[1], generator=gen), torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    out = cpu_kernels.gemm(x, cpu_kernels.gemm_pack(weight), bias, shape[0])
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-4)


@needs_own_gemm
def test_fp32_weights_pack_for_the_own_gemm_and_bf16_for_onednn():
    x, weight, bias = _case(torch.float32, 5, True)
    packed = PackedWeight(weight, bias)
    assert packed.own_gemm and packed.weight.numel() == 48 * 96  # 40 columns padded to 48
    torch.testing.assert_close(linear(x, weight, bias, packed), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    if BF16_ONEDNN:
        assert not PackedWeight(weight.bfloat16(), None).own_gemm


def test_the_gemm_refuses_a_packed_weight_of_the_wrong_size():
    x, out, packed = torch.randn(3, 8), torch.empty(3, 20), torch.zeros(20 * 8)
    buf = lambda t: (t.data_ptr(), t.numel())  # noqa: E731
    with pytest.raises(KernelError, match=r"`packed` has 160 elements, the shape needs 256"):
        _core.cpu_gemm(buf(x), buf(packed), None, buf(out), 3, 20, 8, 1)


@needs_own_gemm
def test_every_row_count_takes_the_own_gemm_where_it_packed_the_weight(monkeypatch):
    calls = []
    for name in ("gemm", "gemv"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    for rows in (1, 2, 3):
        x, weight, bias = _case(torch.float32, rows, True)
        out = linear(x, weight, bias, PackedWeight(weight, bias))
        torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert calls == ["gemm", "gemm", "gemm"]


@needs_own_gemm
@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_gemm_is_the_gemm_then_silu_and_mul_bit_for_bit(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 96, generator=gen), torch.randn(2 * 56, 96, generator=gen)
    bias = torch.randn(2 * 56, generator=gen) if with_bias else None
    want = cpu_kernels.silu_and_mul(cpu_kernels.gemm(x, cpu_kernels.gemm_pack(weight), bias, 2 * 56))
    got = cpu_kernels.gemm_silu_mul(x, cpu_kernels.gemm_pack(weight, parts=2), bias, 56)
    assert torch.equal(got, want)
    gate, up = F.linear(x.double(), weight.double(), None if bias is None else bias.double()).chunk(2, dim=1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, rtol=1e-5, atol=2e-4)


def test_gemm_pack_refuses_parts_that_do_not_divide_the_rows():
    with pytest.raises(KernelError, match=r"`parts` must be >= 1 and divide the 5 output features. Given: 2"):
        cpu_kernels.gemm_pack(torch.randn(5, 8), parts=2)


@needs_own_gemm
def test_a_silu_mlp_runs_gate_up_and_the_activation_as_one_kernel(monkeypatch):
    torch.manual_seed(0)
    mlp = LlamaMLP(32, 48, "silu", False, torch.float32)
    for param in mlp.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(5, 32)
    unpacked = mlp(x)
    mlp.gate_up_proj.pack_for_cpu()
    mlp.down_proj.pack_for_cpu()
    calls = []
    for name in ("gemm", "gemm_silu_mul", "silu_and_mul"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    torch.testing.assert_close(mlp(x), unpacked, rtol=1e-5, atol=1e-5)
    assert calls == ["gemm_silu_mul", "gemm"]
    # The gated pack still serves the plain product, half by half.
    torch.testing.assert_close(mlp.gate_up_proj(x), F.linear(x, mlp.gate_up_proj.weight), rtol=1e-5, atol=1e-5)


def test_an_mlp_with_another_activation_packs_gate_up_whole():
    mlp = LlamaMLP(32, 48, "gelu_pytorch_tanh", False, torch.float32)
    mlp.gate_up_proj.pack_for_cpu()
    assert not mlp.gate_up_proj.gated and mlp.gate_up_proj.silu_and_mul(torch.randn(2, 32)) is None
