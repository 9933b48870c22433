"""ferrollm's bf16-weight GEMM (`kernels.cpu.gemm_bf16`) against an f64 reference on odd shapes
(rows 1 to 9, columns and inputs not multiples of 8, 16 or the 48-wide panel), through the widest
loop this CPU runs, each picked by `FERROLLM_CPU_GEMM` (the portable one runs on any CPU; AMX and
AVX512-BF16 where the CPU has them, with the Rust unit tests)."""

from __future__ import annotations

import pytest
import torch
from ferrollm import _core
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.kernels.cpu import gemm_bf16

pytestmark = pytest.mark.skipif(not cpu_kernels.supports(torch.empty(1)), reason="no OpenMP team to join")

SHAPES = [(rows, 13 + 23 * rows, 7 + 10 * rows) for rows in range(1, 10)] + [(2, 1153, 896), (33, 100, 129), (48, 70, 96)]


BEST = gemm_bf16.KERNELS.index(_core.cpu_gemm_bf16_kernel())


@pytest.fixture(params=gemm_bf16.KERNELS)
def loop(request, monkeypatch):
    """Each loop this CPU runs, picked as a user would: ``FERROLLM_CPU_GEMM``."""
    if gemm_bf16.KERNELS.index(request.param) > BEST:
        pytest.skip(f"this CPU does not run the {request.param} loop")
    monkeypatch.setenv("FERROLLM_CPU_GEMM", request.param)
    assert gemm_bf16.kernel() == request.param
    return request.param


@pytest.mark.parametrize(("rows", "n", "k"), SHAPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_f64_reference(loop, rows, n, k, x_dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(x_dtype)
    packed = gemm_bf16.pack(weight)
    assert packed.numel() == gemm_bf16.packed_len(n, k)
    assert torch.equal(gemm_bf16.unpack(packed, n, k), weight)
    out = gemm_bf16.linear(x, packed, bias, n)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    want = x.double() @ weight.double().T + bias.double()
    # fp32 sums of k products: ~k·eps of the terms' size; bf16 output adds one rounding.
    tol = 1e-6 * k ** 0.5 * 4 + (1 / 128 if x_dtype == torch.bfloat16 else 0)
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * k ** 0.5)


def test_packing_row_blocks_from_a_strided_view_equals_packing_the_whole(loop):
    weight = torch.randn(130, 9).to(torch.bfloat16)
    wide = torch.cat([weight, torch.zeros(130, 3, dtype=torch.bfloat16)], dim=1)
    packed = torch.zeros(gemm_bf16.packed_len(130, 9), dtype=torch.bfloat16)
    for first, rows in [(0, 50), (50, 1), (51, 79)]:
        gemm_bf16.pack_rows(wide[first:first + rows, :9], packed, 130, first)
    assert torch.equal(packed, gemm_bf16.pack(weight))
