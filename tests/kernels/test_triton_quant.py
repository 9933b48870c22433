"""The quantized Triton matmuls and activation quantizers, run by Triton's interpreter on the CPU
against their torch references; the ``gpu`` tests at the bottom run them compiled on a device
(``TRITON_INTERPRET=0 pytest -m gpu tests/kernels/test_triton_quant.py``).

Tolerances. The quantizers are compared bit for bit: kernel and reference do the same float32
operations, and e4m3 encoding is checked against torch's own cast. The matmuls sum exact
products (codes are exact in every operand dtype) in another order and apply scales at another
point than the dequantize-then-matmul references, so float32 results differ by a few float32
roundings of the sum of magnitudes (``atol = 1e-5 * max|ref|``, ``rtol = 1e-5``); 16-bit results
are the same float32 values rounded once, so they may differ by one unit in the last place
(``rtol`` = 2**-7 for bfloat16, 2**-10 for float16: an ulp over the value, at its largest).
"""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must come before ferrollm.kernels.triton)
import pytest
import torch
from triton import knobs

from ferrollm.kernels.triton import (
    fp8_linear,
    fp8_linear_ref,
    scaled_fp8_quant,
    scaled_fp8_quant_ref,
    scaled_int8_quant,
    scaled_int8_quant_ref,
    w8a8_linear,
    w8a8_linear_ref,
    wq_linear,
    wq_linear_ref,
)
from ferrollm.kernels.triton.quant._split_k import choose_split_k, num_sms, split_k_for

torch.set_num_threads(1)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 17, 64]
ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one ulp, relative


def randn(*shape, dtype=torch.float32, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def assert_matmul_close(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out, ref, rtol=ULP[out.dtype], atol=1e-5 * scale)


def int4_weight(out_features, in_features, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (out_features, in_features // 2), generator=gen, dtype=torch.uint8, device=device)


def int8_weight(out_features, in_features, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8, device=device)


def fp8_weight(out_features, in_features, seed, device="cpu"):
    return (randn(out_features, in_features, seed=seed, device=device) * 40).to(torch.float8_e4m3fn)


# --- activation quantizers ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale,zero_point", [(None, 0), (0.02, 0), (0.015, -7)])
def test_int8_quant_matches_reference_bit_for_bit(dtype, scale, zero_point):
    x = randn(5, 1100, dtype=dtype)  # two 1024-column passes per row
    x[1] = 0  # an all-zero row: scale 0, codes 0
    x[2, :4] = torch.tensor([9.0, -9.0, 0.0, 100.0])  # beyond a static scale's range: clamped
    static = None if scale is None else torch.tensor(scale)
    q, s = scaled_int8_quant(x, static, zero_point)
    q_ref, s_ref = scaled_int8_quant_ref(x, static, zero_point)
    assert q.dtype == torch.int8 and torch.equal(q, q_ref) and torch.equal(s, s_ref)
    if scale is None:
        assert s[1] == 0 and not q[1].any() and (q.abs().amax(dim=1)[[0, 2, 3, 4]] == 127).all()


def test_int8_quant_rounds_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.49]])  # amax 127: 127 / amax == 1
    q, s = scaled_int8_quant(x)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -126, 3]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale,group_size", [(None, None), (0.05, None), (None, 32), (None, 48)])
def test_fp8_quant_matches_reference_bit_for_bit(dtype, scale, group_size):
    x = randn(4, 100, dtype=dtype) * 30  # 100 columns: the last group is partial
    x[3] = 0
    static = None if scale is None else torch.tensor(scale)
    q, s = scaled_fp8_quant(x, static, group_size)
    q_ref, s_ref = scaled_fp8_quant_ref(x, static, group_size)
    assert q.dtype == torch.float8_e4m3fn
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_fp8_encoding_rounds_like_torch_at_every_code_and_midpoint():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[~codes.isnan()].unique()  # -448 .. 448, subnormals, one zero
    midpoints = (finite[1:] + finite[:-1]) / 2  # exact in float32; ties round to the even code
    nudged = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    x = torch.cat([finite, midpoints, nudged, torch.tensor([-0.0, 500.0, -1e6, 1e-30])])[None, :]
    q, _ = scaled_fp8_quant(x, torch.tensor(1.0))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


# --- weight-only int4 / int8 ----------------------------------------------------------------

# (in_features, group_size): power-of-two groups, a group that is not a power of two (tiles of
# 16), one group spanning a row that is not a multiple of the tile (masked K).
GROUPS = [(128, 16), (128, 32), (96, 48), (128, 64), (80, 80)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_features,group_size", GROUPS)
@pytest.mark.parametrize("with_mins", [False, True])
def test_wq_linear_matches_dequantize_then_matmul(bits, in_features, group_size, with_mins):
    case = GROUPS.index((in_features, group_size)) + 2 * with_mins + (bits == 8)
    rows, dtype, with_bias = ROWS[case % 4], DTYPES[case % 3], case % 2 == 0
    # two N tiles, the second partial
    x, qweight, scales, mins, bias = _wq_operands(case, rows, 70, in_features, group_size, bits, dtype,
                                                  with_mins, with_bias)
    out = wq_linear(x, qweight, scales, mins, bits, group_size, bias)
    assert_matmul_close(out, wq_linear_ref(x, qweight, scales, mins, bits, group_size, bias))


def _wq_operands(case, rows, out_features, in_features, group_size, bits, dtype, with_mins, with_bias):
    """x, the packed weight, its group scales (and mins) and a bias for a weight-only case, all
    drawn from seeds derived from `case`."""
    x = randn(rows, in_features, dtype=dtype, seed=case)
    qweight = (int4_weight if bits == 4 else int8_weight)(out_features, in_features, seed=case)
    num_groups = in_features // group_size
    scales = torch.rand(out_features, num_groups, generator=torch.Generator().manual_seed(case)) * 0.1
    mins = randn(out_features, num_groups, seed=case + 1) if with_mins else None
    bias = randn(out_features, dtype=dtype, seed=case + 2) if with_bias else None
    return x, qweight, scales, mins, bias


def test_wq_linear_keeps_leading_dimensions_over_several_row_tiles():
    x = randn(2, 33, 64)  # 66 rows: two 64-row tiles
    qweight, scales = int4_weight(20, 64, seed=1), torch.rand(20, 2) * 0.1
    out = wq_linear(x, qweight, scales, None, 4, 32)
    assert out.shape == (2, 33, 20)
    assert_matmul_close(out, wq_linear_ref(x, qweight, scales, None, 4, 32))


def test_wq_linear_int4_nibble_order():
    # One input is 1, the rest 0: the output reads one code per row, low nibble first.
    qweight = torch.tensor([[0x21, 0x43] + [0] * 6, [0xF0, 0x0F] + [0] * 6], dtype=torch.uint8)
    scales = torch.ones(2, 1)
    for k, want in enumerate([[1, 0], [2, 15], [3, 15], [4, 0]]):
        x = torch.zeros(1, 16)
        x[0, k] = 1
        assert wq_linear(x, qweight, scales, None, 4, 16).tolist() == [want]


# --- W8A8 int8 ------------------------------------------------------------------------------

@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("input_scale,zero_point", [(None, 0), (0.03, 0), (0.04, 6)])
def test_w8a8_linear_matches_reference(rows, input_scale, zero_point):
    case = ROWS.index(rows)
    dtype, with_bias = DTYPES[case % 3], case % 2 == 1
    x = randn(rows, 96, dtype=dtype, seed=case) + (0.5 if zero_point else 0.0)  # skewed for a zero point
    qweight = int8_weight(70, 96, seed=case)
    weight_scale = torch.rand(70, generator=torch.Generator().manual_seed(case)) * 0.01
    bias = randn(70, dtype=dtype, seed=case + 1) if with_bias else None
    static = None if input_scale is None else torch.tensor(input_scale)
    out = w8a8_linear(x, qweight, weight_scale, bias, static, zero_point)
    ref = w8a8_linear_ref(x, qweight, weight_scale, bias, static, zero_point)
    assert_matmul_close(out, ref)
    # The quantization itself is reasonable: close to the unquantized product.
    exact = x.float() @ (qweight.float() * weight_scale[:, None]).T + (0 if bias is None else bias.float())
    assert (out.float() - exact).abs().max() < 0.05 * exact.abs().max()


# --- FP8 ------------------------------------------------------------------------------------

# (weight scale kind, block_size, input_quant): every input mode with the weight layouts it
# meets in checkpoints, block scales with partial blocks in both dimensions.
FP8_CASES = [
    ("tensor", None, "none"), ("tensor", None, "tensor"), ("channel", None, "static"),
    ("channel", None, "tensor"), ("block", (32, 32), "group"), ("block", (16, 48), "none"),
    ("block", (32, 32), "tensor"),
]


def fp8_weight_scale(kind, block_size, out_features, in_features, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "tensor":
        return torch.rand((), generator=gen) * 0.02
    if kind == "channel":
        return torch.rand(out_features, generator=gen) * 0.02
    shape = (-(-out_features // block_size[0]), -(-in_features // block_size[1]))
    return torch.rand(shape, generator=gen) * 0.02


@pytest.mark.parametrize("kind,block_size,input_quant", FP8_CASES)
@pytest.mark.parametrize("fp8_dot", [False, True])
def test_fp8_linear_matches_reference(kind, block_size, input_quant, fp8_dot):
    case = FP8_CASES.index((kind, block_size, input_quant)) + fp8_dot
    rows, dtype, with_bias = ROWS[case % 4], DTYPES[case % 3], case % 2 == 0
    x = randn(rows, 112, dtype=dtype, seed=case)  # 112 = 3.5 blocks of 32, 2.33 of 48
    weight = fp8_weight(70, 112, seed=case)
    scale = fp8_weight_scale(kind, block_size, 70, 112, seed=case)
    bias = randn(70, dtype=dtype, seed=case + 1) if with_bias else None
    static = torch.tensor(0.02) if input_quant == "static" else None
    args = (x, weight.view(torch.uint8) if case % 2 else weight, scale, bias, block_size, input_quant, static)
    out = fp8_linear(*args, fp8_dot=fp8_dot)
    assert_matmul_close(out, fp8_linear_ref(*args))


@pytest.mark.parametrize("weight_scale", ["tensor", "channel"])
def test_fp8_linear_agrees_with_torch_scaled_mm(weight_scale):
    x, weight = randn(17, 64) * 3, fp8_weight(48, 64, seed=3)
    scale = fp8_weight_scale(weight_scale, None, 48, 64, seed=3)
    qx, s_x = scaled_fp8_quant(x)
    try:
        want = torch._scaled_mm(qx, weight.t(), scale_a=s_x.reshape(1, 1).expand(17, 1).contiguous(),
                                scale_b=scale.reshape(1, -1).expand(1, 48).contiguous(), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm does not run here: {e}")
    assert_matmul_close(fp8_linear(x, weight, scale), want)


# --- split-K at decode ----------------------------------------------------------------------

# 1 runs the unsplit kernel; the odd splits divide neither K nor its number of tiles.
SPLITS = [1, 2, 3, 5, 7]
DECODE_ROWS = [1, 2, 3, 4]
# (in_features, group_size): 7 tiles of 32, one group each; 5 groups of 128; one group (GPTQ's
# group_size -1) of 400 in 4 tiles of 128, the last masked.
SPLIT_GROUPS = [(224, 32), (640, 128), (400, 400)]


@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("in_features,group_size", SPLIT_GROUPS)
def test_wq_linear_split_k_matches_reference(split_k, bits, in_features, group_size):
    case = SPLITS.index(split_k) + 5 * SPLIT_GROUPS.index((in_features, group_size)) + bits
    rows, dtype, with_mins, with_bias = DECODE_ROWS[case % 4], DTYPES[case % 3], case % 2 == 0, case % 4 < 2
    # two N tiles, the second partial
    x, qweight, scales, mins, bias = _wq_operands(case, rows, 67, in_features, group_size, bits, dtype,
                                                  with_mins, with_bias)
    out = wq_linear(x, qweight, scales, mins, bits, group_size, bias, split_k=split_k)
    assert_matmul_close(out, wq_linear_ref(x, qweight, scales, mins, bits, group_size, bias))


@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("input_scale,zero_point", [(None, 0), (0.03, 0), (0.04, 6), (0.05, -9)])
def test_w8a8_linear_split_k_matches_reference(split_k, input_scale, zero_point):
    # 600 inputs: 5 tiles of 128, the last masked. With a zero point each split subtracts the
    # column sums of its own range, so a correction applied twice or not at all shows.
    case = SPLITS.index(split_k) + 2 * (zero_point != 0)
    rows, dtype, with_bias = DECODE_ROWS[case % 4], DTYPES[case % 3], case % 2 == 1
    x = randn(rows, 600, dtype=dtype, seed=case) + (0.5 if zero_point else 0.0)
    qweight = int8_weight(67, 600, seed=case)
    weight_scale = torch.rand(67, generator=torch.Generator().manual_seed(case)) * 0.01
    bias = randn(67, dtype=dtype, seed=case + 1) if with_bias else None
    static = None if input_scale is None else torch.tensor(input_scale)
    out = w8a8_linear(x, qweight, weight_scale, bias, static, zero_point, split_k=split_k)
    assert_matmul_close(out, w8a8_linear_ref(x, qweight, weight_scale, bias, static, zero_point))


@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("kind,block_size,input_quant", FP8_CASES)
def test_fp8_linear_split_k_matches_reference(split_k, kind, block_size, input_quant):
    # 400 inputs: 4 tiles of 128 (the last masked), 13 of 32 or 25 of 16 with block scales.
    case = SPLITS.index(split_k) + FP8_CASES.index((kind, block_size, input_quant))
    rows, dtype, with_bias = DECODE_ROWS[case % 4], DTYPES[case % 3], case % 2 == 0
    x = randn(rows, 400, dtype=dtype, seed=case)
    weight = fp8_weight(67, 400, seed=case)
    scale = fp8_weight_scale(kind, block_size, 67, 400, seed=case)
    bias = randn(67, dtype=dtype, seed=case + 1) if with_bias else None
    static = torch.tensor(0.02) if input_quant == "static" else None
    args = (x, weight, scale, bias, block_size, input_quant, static)
    out = fp8_linear(*args, fp8_dot=case % 2 == 1, split_k=split_k)
    assert_matmul_close(out, fp8_linear_ref(*args))


def test_choose_split_k_fills_idle_sms_at_decode_only():
    # Qwen2.5-3B's o_proj (2048 x 2048) at batch 1 on a 132-SM H200: 32 column tiles, so 4
    # splits of 4 tiles of 128 fill one wave of 128 programs.
    assert choose_split_k(1, 2048, 2048, 128, sms=132) == 4
    assert choose_split_k(4, 256, 2048, 128, sms=132) == 16  # k/v: 4 column tiles, one split per K tile
    assert choose_split_k(2048, 2048, 2048, 128, sms=132) == 1  # prefill: row tiles fill the GPU
    assert choose_split_k(64, 2048, 2048, 128, sms=132) == 4  # the largest decode tile still splits
    assert choose_split_k(1, 22016, 2048, 128, sms=132) == 1  # gate/up: 344 column tiles
    assert choose_split_k(1, 2048, 2048, 128, sms=48) == 1  # 32 tiles already fill most of 48 SMs
    for rows in (1, 3, 16, 64):
        for out_features in (64, 256, 1000, 2048, 4096):
            split = choose_split_k(rows, out_features, 4096, 128, sms=132)
            assert split * -(-out_features // 64) <= 132  # never past one wave


def test_split_k_is_capped_at_one_range_per_tile_and_checked():
    cpu = torch.device("cpu")
    assert split_k_for(3, 1, 67, 600, 128, cpu) == 3
    assert split_k_for(7, 1, 67, 600, 128, cpu) == 5  # 5 tiles of 128
    assert split_k_for(None, 1, 67, 600, 128, cpu) == choose_split_k(1, 67, 600, 128, num_sms(cpu))
    for bad in (0, -2, 2.0):
        with pytest.raises(ValueError, match="split_k"):
            w8a8_linear(randn(1, 64), int8_weight(8, 64, seed=0), torch.ones(8), split_k=bad)


# --- argument checks ------------------------------------------------------------------------

def test_bad_arguments_are_errors_naming_them():
    x, q4, s = randn(2, 64), int4_weight(8, 64, seed=0), torch.ones(8, 2)
    with pytest.raises(ValueError, match="bits"):
        wq_linear(x, q4, s, None, 3, 32)
    with pytest.raises(ValueError, match="group_size"):
        wq_linear(x, q4, torch.ones(8, 8), None, 4, 8)
    with pytest.raises(ValueError, match="scales"):
        wq_linear(x, q4, torch.ones(8, 3), None, 4, 32)
    with pytest.raises(ValueError, match="in_features"):
        wq_linear(randn(2, 32), q4, s, None, 4, 32)
    with pytest.raises(ValueError, match="bias"):
        w8a8_linear(x, int8_weight(8, 64, seed=0), torch.ones(8), torch.ones(7))
    with pytest.raises(ValueError, match="weight_scale"):
        w8a8_linear(x, int8_weight(8, 64, seed=0), torch.ones(4))
    with pytest.raises(ValueError, match="zero_point"):
        scaled_int8_quant(x, torch.tensor(1.0), 200)
    w8 = fp8_weight(8, 64, seed=0)
    with pytest.raises(ValueError, match="input_quant"):
        fp8_linear(x, w8, torch.ones(()), input_quant="token")
    with pytest.raises(ValueError, match="block_size"):
        fp8_linear(x, w8, torch.ones(()), input_quant="group")
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear(x, w8, torch.ones(()), input_quant="static")
    with pytest.raises(ValueError, match=r"weight_scale.*\(1, 2\)"):
        fp8_linear(x, w8, torch.ones(2, 2), block_size=(8, 32))
    with pytest.raises(ValueError, match="weight"):
        fp8_linear(x, w8.float(), torch.ones(()))


# --- compiled, on a GPU ---------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or knobs.runtime.interpret,
                               reason="needs a CUDA device and TRITON_INTERPRET=0")
GPU_ROWS = [1, 7, 33, 300]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("bits,group_size,with_mins", [(4, 128, False), (4, 32, True), (8, 4096, False), (8, 64, True)])
def test_gpu_wq_linear(dtype, rows, bits, group_size, with_mins):
    x = randn(rows, 4096, dtype=dtype, device="cuda")
    qweight = (int4_weight if bits == 4 else int8_weight)(1000, 4096, seed=1, device="cuda")
    scales = torch.rand(1000, 4096 // group_size, device="cuda") * 0.01
    mins = randn(1000, 4096 // group_size, seed=2, device="cuda") * 0.01 if with_mins else None
    bias = randn(1000, dtype=dtype, seed=3, device="cuda")
    out = wq_linear(x, qweight, scales, mins, bits, group_size, bias)
    assert_matmul_close(out, wq_linear_ref(x, qweight, scales, mins, bits, group_size, bias))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("input_scale,zero_point", [(None, 0), (0.03, 5)])
def test_gpu_int8_quantizer_and_w8a8(dtype, rows, input_scale, zero_point):
    x = randn(rows, 4096, dtype=dtype, device="cuda") * 4
    static = None if input_scale is None else torch.tensor(input_scale, device="cuda")
    q, s = scaled_int8_quant(x, static, zero_point)
    q_ref, s_ref = scaled_int8_quant_ref(x, static, zero_point)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    qweight, weight_scale = int8_weight(1000, 4096, seed=1, device="cuda"), torch.rand(1000, device="cuda") * 0.01
    bias = randn(1000, dtype=dtype, seed=2, device="cuda")
    out = w8a8_linear(x, qweight, weight_scale, bias, static, zero_point)
    assert_matmul_close(out, w8a8_linear_ref(x, qweight, weight_scale, bias, static, zero_point))


@pytest.mark.gpu
@needs_gpu
def test_gpu_split_k_decode_captures_in_a_cuda_graph():
    # Batch 1 against 1000 outputs (16 column tiles): every product splits K on a many-SM GPU.
    x = randn(1, 4096, dtype=torch.bfloat16, device="cuda")
    assert choose_split_k(1, 1000, 4096, 128, num_sms(x.device)) > 1
    bias = randn(1000, dtype=torch.bfloat16, seed=2, device="cuda")
    q8, s8 = int8_weight(1000, 4096, seed=1, device="cuda"), torch.rand(1000, device="cuda") * 0.01
    q4, s4 = int4_weight(1000, 4096, seed=1, device="cuda"), torch.rand(1000, 32, device="cuda") * 0.01
    f8, sf8 = fp8_weight(1000, 4096, seed=1, device="cuda"), torch.rand(1000, device="cuda") * 0.02
    static = torch.tensor(0.03, device="cuda")
    products = [
        (w8a8_linear, w8a8_linear_ref, (q8, s8, bias, static, 5)),
        (wq_linear, wq_linear_ref, (q4, s4, None, 4, 128, bias)),
        (fp8_linear, fp8_linear_ref, (f8, sf8, bias)),
    ]
    for kernel, _, args in products:  # compile before capturing
        kernel(x, *args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [kernel(x, *args) for kernel, _, args in products]
    x.copy_(randn(1, 4096, dtype=torch.bfloat16, seed=5, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    for out, (_, ref, args) in zip(outs, products):
        assert_matmul_close(out, ref(x, *args))


GPU_FP8_CASES = FP8_CASES[:4] + [("block", (128, 128), "group"), ("block", (128, 128), "none"),
                                 ("block", (128, 128), "tensor")]


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", GPU_ROWS)
@pytest.mark.parametrize("kind,block_size,input_quant", GPU_FP8_CASES)
@pytest.mark.parametrize("fp8_dot", [None, False])
def test_gpu_fp8_quantizer_and_linear(dtype, rows, kind, block_size, input_quant, fp8_dot):
    x = randn(rows, 4096, dtype=dtype, device="cuda") * 3
    static = torch.tensor(0.02, device="cuda") if input_quant == "static" else None
    if input_quant != "none":
        group_size = block_size[1] if input_quant == "group" else None
        q, s = scaled_fp8_quant(x, static, group_size)
        q_ref, s_ref = scaled_fp8_quant_ref(x, static, group_size)
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    weight = fp8_weight(1008, 4096, seed=1, device="cuda")  # _scaled_mm takes multiples of 16
    scale = fp8_weight_scale(kind, block_size, 1008, 4096, seed=1).cuda()
    bias = randn(1008, dtype=dtype, seed=2, device="cuda")
    out = fp8_linear(x, weight, scale, bias, block_size, input_quant, static, fp8_dot=fp8_dot)
    ref = fp8_linear_ref(x, weight, scale, bias, block_size, input_quant, static)
    # sm_90's float8 MMA keeps fewer bits than float32 while it sums a 128-wide tile: allow
    # 1e-3 of the largest output there.
    float8_mma = fp8_dot is None and input_quant != "none" and torch.cuda.get_device_capability() >= (9, 0)
    largest = ref.float().abs().max().item()
    torch.testing.assert_close(out, ref, rtol=ULP[dtype], atol=(1e-3 if float8_mma else 1e-5) * largest)
    if kind == "tensor" and input_quant == "tensor":
        qx, s_x = scaled_fp8_quant(x)
        want = torch._scaled_mm(qx, weight.t(), scale_a=s_x.reshape(()), scale_b=scale.reshape(()),
                                bias=bias, out_dtype=dtype)
        torch.testing.assert_close(out, want, rtol=2 * ULP[dtype], atol=1e-3 * largest)
