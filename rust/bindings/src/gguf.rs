//! GGUF block decoding and products (`ferrollm_kernels::quant`) on numpy/torch memory.
//!
//! Buffers cross as `(address, length)` pairs, as in `cpu_kernels`: `data` and `weight` are a
//! tensor's bytes (usually a view of the memory-mapped file), `out` a contiguous float32 or
//! bfloat16 tensor the caller has just allocated. The one caller is `ferrollm.kernels.cpu.gguf`.

use ferrollm_kernels::quant::{self, dequantize, GgmlType, QuantWeight};
use ferrollm_kernels::{Bf16, Element};
use pyo3::prelude::*;

use crate::buffers::{view, view_mut};
use crate::errors::{kernel_error, raise};

/// Whether `cpu_gguf_dequantize` decodes the GGML type with this id.
#[pyfunction]
pub fn cpu_gguf_supported(ggml_type: u32) -> bool {
    GgmlType::from_id(ggml_type).is_some()
}

/// Decodes `data` (`(address, bytes)`), whole blocks of GGML type `ggml_type`, into `out`
/// (`(address, elements)` of `dtype`, 'float32' or 'bfloat16').
#[pyfunction]
#[pyo3(signature = (ggml_type, data, dtype, out, threads))]
pub fn cpu_gguf_dequantize(
    py: Python<'_>,
    ggml_type: u32,
    data: (usize, usize),
    dtype: &str,
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    let Some(ggml_type) = GgmlType::from_id(ggml_type) else {
        return Err(raise("KernelError", format!("GGML type {ggml_type} has no block decoder")));
    };
    match dtype {
        "float32" => run::<f32>(py, ggml_type, data, out, threads),
        "bfloat16" => run::<Bf16>(py, ggml_type, data, out, threads),
        other => {
            Err(raise("KernelError", format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'")))
        }
    }
}

/// Whether `cpu_gguf_linear` computes from blocks of the GGML type with this id.
#[pyfunction]
pub fn cpu_gguf_linear_supported(ggml_type: u32) -> bool {
    GgmlType::from_id(ggml_type).is_some_and(quant::matmul::supported)
}

/// `out[rows, Σ out_features] = x[rows, in_features] · [W₀; W₁; …]ᵀ + bias` (float32): the
/// weights stacked along the output features, each `(ggml_type, (address, bytes), row_stride,
/// out_features)`, its bytes spanning row 0's first byte to the last row's last, row `n`
/// starting `n * row_stride` bytes in.
#[pyfunction]
#[pyo3(signature = (weights, in_features, x, rows, bias, out, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gguf_linear(
    py: Python<'_>,
    weights: Vec<(u32, (usize, usize), usize, usize)>,
    in_features: usize,
    x: (usize, usize),
    rows: usize,
    bias: Option<(usize, usize)>,
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    let mut stacked = Vec::with_capacity(weights.len());
    for (ggml_type, data, row_stride, out_features) in weights {
        let Some(ggml_type) = GgmlType::from_id(ggml_type) else {
            return Err(raise("KernelError", format!("GGML type {ggml_type} has no block product")));
        };
        // SAFETY: the caller passes live buffers of these lengths (see the module doc), which
        // nothing writes during the call.
        let data = unsafe { view::<u8>(data) };
        stacked.push(QuantWeight { ggml_type, data, row_stride, out_features, in_features });
    }
    // SAFETY: as above; `out` is a fresh tensor aliasing nothing.
    let (x, bias, out) = unsafe { (view::<f32>(x), bias.map(|b| view::<f32>(b)), view_mut::<f32>(out)) };
    py.detach(|| quant::matmul_stacked(&stacked, x, rows, bias, out, threads)).map_err(kernel_error)
}

fn run<T: Element>(
    py: Python<'_>,
    ggml_type: GgmlType,
    data: (usize, usize),
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    // SAFETY: the caller passes live buffers of these lengths (see the module doc); `out` is a
    // fresh tensor of `T`, aliasing nothing, and nothing writes `data` during the call.
    let (data, out) = unsafe { (view::<u8>(data), view_mut::<T>(out)) };
    py.detach(|| dequantize(ggml_type, data, out, threads)).map_err(kernel_error)
}
