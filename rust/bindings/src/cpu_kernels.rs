//! The CPU kernels (`ferrollm-kernels`) on torch tensors' memory.
//!
//! Tensors cross as `(data_ptr, numel)` pairs plus a dtype name: torch's bfloat16 has no numpy
//! dtype, so the buffer protocol cannot carry it. The one caller, `ferrollm.cpu_kernels`, passes
//! only contiguous CPU tensors of the named dtype, and outputs it has just allocated (so they
//! alias no input). The kernels check every length against the shape they are given.

use ferrollm_kernels::gemv::{gemv, GemvShape};
use ferrollm_kernels::{openmp, Bf16};
use pyo3::prelude::*;

use crate::errors::{kernel_error, raise};

/// A tensor's memory: its first element's address and element count.
type Buffer = (usize, usize);

/// # Safety
/// `buf` must address `buf.1` initialised, live elements of `T` that nothing writes during the call.
unsafe fn view<'a, T>(buf: Buffer) -> &'a [T] {
    if buf.1 == 0 {
        return &[];
    }
    std::slice::from_raw_parts(buf.0 as *const T, buf.1)
}

/// # Safety
/// As [`view`], and nothing else reads or writes the elements during the call.
unsafe fn view_mut<'a, T>(buf: Buffer) -> &'a mut [T] {
    if buf.1 == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(buf.0 as *mut T, buf.1)
}

/// Joins the OpenMP runtime at `path`, already loaded in this process (torch's). Raises
/// `KernelError` if it is not loaded or lacks the OpenMP entry points.
#[pyfunction]
pub fn cpu_openmp_attach(py: Python<'_>, path: &str) -> PyResult<()> {
    py.detach(|| openmp::attach(path)).map_err(kernel_error)
}

/// `out[rows, out_features] = x[rows, in_features] · weight[out_features, in_features]ᵀ + bias`.
#[pyfunction]
#[pyo3(signature = (dtype, x, weight, bias, out, rows, out_features, in_features, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemv(
    py: Python<'_>,
    dtype: &str,
    x: Buffer,
    weight: Buffer,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> PyResult<()> {
    let shape = GemvShape { rows, out_features, in_features };
    macro_rules! run {
        ($t:ty) => {
            // SAFETY: the caller passes live, contiguous buffers of `$t`, `out` freshly allocated.
            py.detach(|| unsafe {
                gemv::<$t>(view(x), view(weight), bias.map(|b| view(b)), view_mut(out), shape, threads)
            })
        };
    }
    let result = match dtype {
        "float32" => run!(f32),
        "bfloat16" => run!(Bf16),
        other => {
            return Err(raise(
                "KernelError",
                format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'"),
            ))
        }
    };
    result.map_err(kernel_error)
}
