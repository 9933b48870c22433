"""The Rust CPU kernels (`ferrollm.kernels.cpu`): the streaming GEMV against F.linear, on torch's
OpenMP team, and the cases it leaves to torch."""

import pytest
import torch
import torch.nn.functional as F

from ferrollm import _core
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.exceptions import KernelError
from ferrollm.model_executor.layers.cpu_weights import dense_linear

OPENMP = "parallel backend: OpenMP" in torch.__config__.parallel_info()
needs_openmp = pytest.mark.skipif(not OPENMP, reason="torch runs on a thread pool other than OpenMP")


def _case(dtype: torch.dtype, rows: int, out_features: int, in_features: int, with_bias: bool):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    return x, weight, bias


@needs_openmp
def test_the_kernels_join_torchs_openmp_team():
    assert cpu_kernels._joined_openmp()


@needs_openmp
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("shape", [(40, 96), (7, 37), (1153, 896), (3, 4864)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp32_gemv_matches_f_linear(rows, shape, with_bias):
    x, weight, bias = _case(torch.float32, rows, *shape, with_bias)
    assert cpu_kernels.gemv_supported(x, weight)
    out = cpu_kernels.gemv(x, weight, bias)
    assert out.shape == (rows, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.double(), weight.double(), None if bias is None else bias.double()).float(),
                               rtol=1e-5, atol=1e-4)


@needs_openmp
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemv_accumulates_in_fp32_and_rounds_once(rows, with_bias):
    x, weight, bias = _case(torch.bfloat16, rows, 300, 200, with_bias)
    out = cpu_kernels.gemv(x, weight, bias)
    assert out.dtype == torch.bfloat16
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # The exact result rounded to bf16 is within half a bf16 step (2^-8 relative) of it.
    torch.testing.assert_close(out.double(), want, rtol=2**-8, atol=1e-3)


@needs_openmp
def test_the_decode_linear_takes_the_gemv_for_one_or_two_rows(monkeypatch):
    calls = []
    real = cpu_kernels.gemv
    monkeypatch.setattr(cpu_kernels, "gemv", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 2, 3):
        x, weight, bias = _case(torch.float32, rows, 40, 96, True)
        torch.testing.assert_close(dense_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert calls == [1, 2]


@needs_openmp
def test_what_the_gemv_leaves_to_torch():
    x, weight, _ = _case(torch.float32, 1, 40, 96, False)
    assert cpu_kernels.gemv_supported(x, weight)
    assert not cpu_kernels.gemv_supported(torch.randn(3, 96), weight)  # three rows: the GEMM's
    assert not cpu_kernels.gemv_supported(x.half(), weight.half())
    assert not cpu_kernels.gemv_supported(x, weight.bfloat16())
    assert not cpu_kernels.gemv_supported(x, torch.randn(96, 40).T)  # a strided view
    assert not cpu_kernels.gemv_supported(x[:0], weight)
    assert not cpu_kernels.gemv_supported(x.to("meta"), weight.to("meta"))


def test_the_switch_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("FERROLLM_CPU_KERNELS", "0")
    cpu_kernels._joined_openmp.cache_clear()
    try:
        x, weight, _ = _case(torch.float32, 1, 40, 96, False)
        assert not cpu_kernels.gemv_supported(x, weight)
    finally:
        cpu_kernels._joined_openmp.cache_clear()


def test_bad_buffers_raise_kernel_error_naming_the_parameter():
    x, weight = torch.randn(1, 8), torch.randn(4, 8)
    out = torch.empty(1, 4)
    buf = lambda t: (t.data_ptr(), t.numel())  # noqa: E731
    with pytest.raises(KernelError, match=r"`weight` has 32 elements, the shape needs 40"):
        _core.cpu_gemv("float32", buf(x), buf(weight), None, buf(out), 1, 5, 8, 1)
    with pytest.raises(KernelError, match=r"`rows` must be between 1 and 2. Given: 3"):
        _core.cpu_gemv("float32", buf(x), buf(weight), None, buf(out), 3, 4, 8, 1)
    with pytest.raises(KernelError, match=r"`dtype` must be 'float32' or 'bfloat16'. Given: 'float16'"):
        _core.cpu_gemv("float16", buf(x), buf(weight), None, buf(out), 1, 4, 8, 1)
    with pytest.raises(KernelError, match=r"not loaded in this process"):
        _core.cpu_openmp_attach("/nonexistent/libgomp.so.1")


@needs_openmp
def test_a_strided_bias_is_read_from_a_copy_that_outlives_the_call():
    x, weight, _ = _case(torch.float32, 1, 40, 96, False)
    bias = torch.randn(40, 2)[:, 0]  # not contiguous: the wrapper copies it
    torch.testing.assert_close(cpu_kernels.gemv(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
