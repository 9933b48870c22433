//! The bf16-weight GEMM (`ferrollm_kernels::gemm_bf16`) on torch tensors' memory.
//!
//! Buffers cross as `(data_ptr, numel)` pairs, as in `cpu_kernels`. The one caller,
//! `ferrollm.kernels.cpu`, passes contiguous CPU tensors (bf16 weights and packs; `x`, `bias`
//! and `out` of the dtype it names) and outputs it has just allocated; the kernel checks every
//! length against the shape it is given.

use ferrollm_kernels::gemm::{GemmShape, RowBlock};
use ferrollm_kernels::gemm_bf16::{gemm_bf16, pack_weight_rows_bf16, packed_len_bf16, Bf16Kernel};
use ferrollm_kernels::Bf16;
use pyo3::prelude::*;

use crate::buffers::{view, view_mut, Buffer};
use crate::errors::{kernel_error, raise};

/// Adds this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_gemm_bf16_kernel, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_gemm_bf16_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_gemm_bf16_pack, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_gemm_bf16, m)?)?;
    Ok(())
}

/// The widest bf16 GEMM kernel this CPU runs: `amx`, `avx512_bf16`, `avx512`, `avx2` or `portable`.
#[pyfunction]
pub fn cpu_gemm_bf16_kernel() -> &'static str {
    Bf16Kernel::best().name()
}

/// Elements (bf16) `cpu_gemm_bf16_pack` writes for an `[out_features, in_features]` weight.
#[pyfunction]
pub fn cpu_gemm_bf16_packed_len(out_features: usize, in_features: usize) -> usize {
    packed_len_bf16(out_features, in_features)
}

/// Packs rows `first_row..first_row + rows` of a bf16 `[out_features, in_features]` weight, row
/// `r` of them at element `r * stride` of `weight`, into their columns of `packed` (zeroed
/// beforehand) for `cpu_gemm_bf16`; the rest of `packed` is left as it is.
#[pyfunction]
#[pyo3(signature = (weight, packed, out_features, in_features, first_row, rows, stride, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemm_bf16_pack(
    py: Python<'_>,
    weight: Buffer,
    packed: Buffer,
    out_features: usize,
    in_features: usize,
    first_row: usize,
    rows: usize,
    stride: usize,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `packed` is the layer's own buffer, written by one call at a time.
    let (weight, packed) = unsafe { (view::<Bf16>(weight), view_mut::<Bf16>(packed)) };
    let block = RowBlock { first: first_row, rows, stride };
    py.detach(|| pack_weight_rows_bf16(weight, block, packed, out_features, in_features, threads))
        .map_err(kernel_error)
}

/// `out[rows, out_features] = x[rows, in_features] · weightᵀ + bias`, summed in f32 from the bf16
/// weight packed by `cpu_gemm_bf16_pack`; `x`, `bias` and `out` are `dtype` (`float32` or
/// `bfloat16`); `kernel` names the loop (`cpu_gemm_bf16_kernel`'s names).
#[pyfunction]
#[pyo3(signature = (dtype, x, packed, bias, out, rows, out_features, in_features, kernel, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemm_bf16(
    py: Python<'_>,
    dtype: &str,
    x: Buffer,
    packed: Buffer,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    kernel: &str,
    threads: usize,
) -> PyResult<()> {
    let Some(kernel) = Bf16Kernel::from_name(kernel) else {
        let names: Vec<_> = Bf16Kernel::ALL.iter().map(|k| k.name()).collect();
        return Err(raise("KernelError", format!("`kernel` must be one of {names:?}. Given: '{kernel}'")));
    };
    let shape = GemmShape { rows, out_features, in_features };
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let packed = unsafe { view::<Bf16>(packed) };
    match dtype {
        "float32" => run::<f32>(py, [x, out], packed, bias, shape, kernel, threads),
        "bfloat16" => run::<Bf16>(py, [x, out], packed, bias, shape, kernel, threads),
        other => {
            Err(raise("KernelError", format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'")))
        }
    }
}

fn run<T: ferrollm_kernels::Element>(
    py: Python<'_>,
    [x, out]: [Buffer; 2],
    packed: &[Bf16],
    bias: Option<Buffer>,
    shape: GemmShape,
    kernel: Bf16Kernel,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let (x, bias, out) = unsafe { (view::<T>(x), bias.map(|b| view::<T>(b)), view_mut::<T>(out)) };
    py.detach(|| gemm_bf16(x, packed, bias, out, shape, kernel, threads)).map_err(kernel_error)
}
