"""The CPU weight forms (`cpu_weights`): each gives F.linear's result from its one copy of the
weight, built from the row blocks the loaders hand over; the packed form runs on every CPU here
through the GEMM's portable loop (`FERROLLM_CPU_GEMM=portable`) where there is no AVX-512."""

import pytest
import torch
import torch.nn.functional as F

from ferrollm import _core
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.exceptions import CheckpointError, KernelError
from ferrollm.model_executor.layers.cpu_gemm import MLP_SLAB_ROWS, row_slabs
from ferrollm.model_executor.layers.cpu_weights import (
    DenseRows,
    OneDnnWeight,
    PackedBf16Weight,
    PackedWeight,
    RowBlocks,
    cpu_weight_form,
)
from ferrollm.model_executor.models.llama import LlamaMLP

BF16_ONEDNN = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
KERNELS = cpu_kernels.supports(torch.empty(1))
needs_kernels = pytest.mark.skipif(not KERNELS, reason="no OpenMP team to join")


@pytest.fixture
def own_gemm(monkeypatch):
    """ferrollm's GEMM on this CPU: vectorized with AVX-512, else its portable loop."""
    if not KERNELS:
        pytest.skip("no OpenMP team to join")
    if not _core.cpu_gemm_vectorized():
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")


def _case(dtype: torch.dtype, rows: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    weight = torch.randn(40, 96, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype) if with_bias else None
    return x, weight, bias


def _blocks(weight: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """``weight`` as row blocks starting at each cut (as q/k/v or gate/up arrive)."""
    edges = [*cuts, weight.shape[0]]
    return [(a, weight[a:b]) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("rows", [1, 2, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cuts", [[0], [0, 24, 32]])
@pytest.mark.parametrize("apart", [False, True])
def test_dense_rows_match_f_linear(rows, with_bias, cuts, apart):
    x, weight, bias = _case(torch.float32, rows, with_bias)
    blocks = [(first, w.clone() if apart else w) for first, w in _blocks(weight, cuts)]
    form = DenseRows(blocks)
    # Back-to-back blocks (gate_proj and up_proj in an HF file) are viewed in place; others
    # (q, k, v) are copied into one weight.
    assert (form.weight.data_ptr() == weight.data_ptr()) == (not apart)
    torch.testing.assert_close(form.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not BF16_ONEDNN, reason="oneDNN has no bf16 path on this CPU")
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_bf16_matches_float32_arithmetic(rows, with_bias):
    x, weight, bias = _case(torch.bfloat16, rows, with_bias)
    out = OneDnnWeight([(0, weight)]).linear(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    # Same bf16 operands, accumulated in fp32: the only difference is the output's bf16 rounding.
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=2e-2)


def test_the_form_follows_the_device_the_dtype_and_the_cpu(monkeypatch):
    cpu = torch.device("cpu")
    assert cpu_weight_form(torch.device("meta"), torch.float32) is None
    assert cpu_weight_form(cpu, torch.float16) is None
    own = KERNELS and _core.cpu_gemm_vectorized()
    assert cpu_weight_form(cpu, torch.float32) == ("packed" if own else "rows")
    assert cpu_weight_form(cpu, torch.bfloat16) == ("packed_bf16" if KERNELS else "rows")
    if KERNELS:
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")
        assert cpu_weight_form(cpu, torch.float32) == "packed"
        assert cpu_weight_form(cpu, torch.bfloat16) == "packed_bf16"
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "onednn")
        assert cpu_weight_form(cpu, torch.bfloat16) == ("onednn" if BF16_ONEDNN else "packed_bf16")


@needs_kernels
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_matches_float32_arithmetic_and_unpacks_exactly(monkeypatch, portable, rows, with_bias):
    if portable:
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")
    x, weight, bias = _case(torch.bfloat16, rows, with_bias)
    # q/k/v-like blocks, one a strided view (a rank's columns of a row-parallel weight).
    wide = torch.cat([weight, torch.zeros(40, 5, dtype=torch.bfloat16)], dim=1)
    blocks = [(0, weight[:24]), (24, wide[24:32, :96]), (32, weight[32:])]
    form = PackedBf16Weight(blocks, 40, 96)
    assert torch.equal(form.dense(), weight)
    out = form.linear(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    want = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=2e-2)
    # fp32 activations against the same bf16 weight: fp32 out, one rounding of the sum apart.
    out32 = form.linear(x.float(), bias)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, want, rtol=1e-5, atol=1e-4)
    # Leading dimensions flatten to rows, and no rows give an empty product.
    torch.testing.assert_close(form.linear(x.float().unsqueeze(0), bias)[0], out32)
    assert form.linear(x[:0], bias).shape == (0, 40)


def test_a_mismatched_input_dtype_falls_back_to_f_linear():
    x, weight, bias = _case(torch.float32, 4, True)
    out = DenseRows([(0, weight.double())]).linear(x.double(), bias.double())
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, F.linear(x.double(), weight.double(), bias.double()))


def test_row_blocks_refuse_rows_that_overlap_or_leave_a_gap():
    blocks = RowBlocks(40, 96, torch.float32)
    blocks.add(0, torch.zeros(24, 96), "q")
    blocks.add(20, torch.zeros(16, 96), "k")
    with pytest.raises(CheckpointError, match="loaded twice"):
        blocks.ordered()
    with pytest.raises(CheckpointError, match=r"expects 8 rows of 96 at row 36 of 40"):
        blocks.add(36, torch.zeros(8, 96), "v")


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


@pytest.mark.parametrize("rows,slabs", [(40, [24, 16]), (33, [24, 9]), (64, [32, 32]), (65, [24, 24, 17])])
def test_row_slabs_are_as_few_and_as_even_as_whole_gemm_blocks_allow(rows, slabs):
    fn_calls = []

    def fn(part):
        fn_calls.append(part.shape[0])
        return part * 2

    x = torch.randn(rows, 4)
    torch.testing.assert_close(row_slabs(fn, x, 32), x * 2)
    assert fn_calls == slabs


def test_the_cpu_mlp_of_a_long_prefill_runs_in_slabs_and_matches_one_pass():
    torch.manual_seed(0)
    mlp = LlamaMLP(32, 48, "silu", False, torch.float32)
    for param in mlp.parameters():
        torch.nn.init.normal_(param, std=0.2)
    x = torch.randn(MLP_SLAB_ROWS * 2 + 5, 32)
    torch.testing.assert_close(mlp(x), mlp._mlp(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("cuts", [[0], [0, 17, 29]])
def test_a_weight_packed_block_by_block_matches_f_linear_and_unpacks_to_itself(own_gemm, rows, cuts):
    x, weight, bias = _case(torch.float32, rows, True)
    packed = PackedWeight(_blocks(weight, cuts), 40, 96)
    assert packed.weight.numel() == 48 * 96  # 40 columns padded to 48
    torch.testing.assert_close(packed.linear(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert torch.equal(packed.dense(), weight)


@needs_kernels
@pytest.mark.parametrize("shape", [(40, 96), (48, 5), (151, 33), (200, 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_back_from_the_panels_are_the_table_s_rows(shape, dtype):
    # A tied head's packed table serves its embedding's lookups: any ids, in the full panels of
    # 48 and in the narrower last one, and odd widths (bf16 packs column pairs).
    table = torch.randn(*shape).to(dtype)
    form = (PackedWeight if dtype == torch.float32 else PackedBf16Weight)([(0, table)], *shape)
    ids = torch.tensor([[0, shape[0] - 1, shape[0] // 2], [shape[0] - 1, 1, 0]])
    assert torch.equal(form.rows(ids), table[ids])
    assert torch.equal(form.rows(torch.arange(shape[0])), table)
    assert form.rows(ids[:0]).shape == (0, 3, shape[1])


def test_a_rank_s_strided_columns_pack_as_their_contiguous_copy(own_gemm):
    full = torch.randn(40, 192)
    a = cpu_kernels.gemm_pack(full[:, 96:].contiguous())
    b = torch.zeros_like(a)
    cpu_kernels.gemm_pack_rows(full[:, 96:], b, 40, 0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 257])
@pytest.mark.parametrize("shape", [(40, 96), (100, 129), (1153, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_own_fp32_gemm_matches_f_linear(own_gemm, rows, shape, with_bias):
    # One row (its own loop), rows around the 8-row block and past the 256-row slab (257 leaves
    # a one-row slab); columns that end mid-vector and mid-panel; k past the 128-row chunk and
    # not a multiple of it. Two threads split the columns.
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, shape[1], generator=gen), torch.randn(*shape, generator=gen)
    bias = torch.randn(shape[0], generator=gen) if with_bias else None
    out = cpu_kernels.gemm(x, cpu_kernels.gemm_pack(weight), bias, shape[0])
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=2e-4)


def test_the_gemm_refuses_a_packed_weight_of_the_wrong_size():
    x, out, packed = torch.randn(3, 8), torch.empty(3, 20), torch.zeros(20 * 8)
    buf = lambda t: (t.data_ptr(), t.numel())  # noqa: E731
    with pytest.raises(KernelError, match=r"`packed` has 160 elements, the shape needs 256"):
        _core.cpu_gemm(buf(x), buf(packed), None, buf(out), 3, 20, 8, 1)


@pytest.mark.parametrize("rows", [1, 3, 32, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_gemm_is_the_gemm_then_silu_and_mul_bit_for_bit(own_gemm, rows, with_bias):
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


def _loaded_mlp(act: str, form: str) -> tuple[LlamaMLP, torch.Tensor, torch.Tensor]:
    """A LlamaMLP whose weights go through its loaders into ``form``; its input and reference."""
    torch.manual_seed(0)
    gate, up, down = torch.randn(48, 32) * 0.2, torch.randn(48, 32) * 0.2, torch.randn(32, 48) * 0.2
    mlp = LlamaMLP(32, 48, act, False, torch.float32)
    for layer in (mlp.gate_up_proj, mlp.down_proj):
        layer.begin_cpu_weight(form)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
    mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
    mlp.down_proj.weight_loader(mlp.down_proj.weight, down)
    x = torch.randn(5, 32)
    act_fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    return mlp, x, F.linear(act_fn(F.linear(x, gate)) * F.linear(x, up), down)


def test_a_silu_mlp_runs_gate_up_and_the_activation_as_one_kernel(own_gemm, monkeypatch):
    mlp, x, want = _loaded_mlp("silu", "packed")
    assert mlp.gate_up_proj.weight.device.type == "meta"  # the packed form holds the only copy
    calls = []
    for name in ("gemm", "gemm_silu_mul", "silu_and_mul"):
        real = getattr(cpu_kernels, name)
        monkeypatch.setattr(cpu_kernels, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert calls == ["gemm_silu_mul", "gemm"]
    # The gated pack still serves the plain product, half by half.
    plain = torch.cat([F.linear(x, w) for w in mlp.gate_up_proj.dense_weight().chunk(2)], dim=1)
    torch.testing.assert_close(mlp.gate_up_proj(x), plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", ["rows", "packed"])
def test_an_mlp_with_another_activation_keeps_gate_up_whole(own_gemm, form):
    mlp, x, want = _loaded_mlp("gelu_pytorch_tanh", form)
    assert not mlp.gate_up_proj.gated and mlp.gate_up_proj.silu_and_mul(x) is None
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
