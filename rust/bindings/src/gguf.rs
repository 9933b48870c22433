//! GGUF block decoding and products (`ferrollm_kernels::quant`) on numpy/torch memory.
//!
//! Buffers cross as `(address, length)` pairs, as in `cpu_kernels`: `data` and `weight` are a
//! tensor's bytes (usually a view of the memory-mapped file), `out` a contiguous float32 or
//! bfloat16 tensor the caller has just allocated. The one caller is `ferrollm.kernels.cpu.gguf`.

use ferrollm_kernels::quant::{self, dequantize, interleaved, GgmlType, Isa, QuantWeight};
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
    let t = block_type(ggml_type)?;
    by_dtype(dtype, || run::<f32>(py, t, data, out, threads), || run::<Bf16>(py, t, data, out, threads))
}

/// Rows `ids` (`(address, count)` of int64) of a `[rows, row_len]` table of GGML type
/// `ggml_type` (`data`, row `n` from byte `n · row_stride`), decoded into `out` (`(address,
/// elements)` of `dtype`, `[count, row_len]`): an embedding lookup from a GGUF file's blocks.
#[pyfunction]
#[pyo3(signature = (ggml_type, data, row_stride, ids, dtype, out, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gguf_embedding(
    py: Python<'_>,
    ggml_type: u32,
    data: (usize, usize),
    row_stride: usize,
    ids: (usize, usize),
    dtype: &str,
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    let t = block_type(ggml_type)?;
    let table = (data, row_stride);
    by_dtype(
        dtype,
        || lookup::<f32>(py, t, table, ids, out, threads),
        || lookup::<Bf16>(py, t, table, ids, out, threads),
    )
}

/// The GGML type with id `ggml_type`, or a `KernelError` for one without a block decoder.
fn block_type(ggml_type: u32) -> PyResult<GgmlType> {
    GgmlType::from_id(ggml_type)
        .ok_or_else(|| raise("KernelError", format!("GGML type {ggml_type} has no block decoder")))
}

/// Runs the branch for the output element type `dtype` names, 'float32' or 'bfloat16'.
fn by_dtype(
    dtype: &str,
    f32_out: impl FnOnce() -> PyResult<()>,
    bf16_out: impl FnOnce() -> PyResult<()>,
) -> PyResult<()> {
    match dtype {
        "float32" => f32_out(),
        "bfloat16" => bf16_out(),
        other => {
            Err(raise("KernelError", format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'")))
        }
    }
}

fn lookup<T: Element>(
    py: Python<'_>,
    ggml_type: GgmlType,
    (data, row_stride): ((usize, usize), usize),
    ids: (usize, usize),
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    // SAFETY: as `run`'s buffers; `ids` is a live int64 tensor of that many elements.
    let (data, ids, out) = unsafe { (view::<u8>(data), view::<i64>(ids), view_mut::<T>(out)) };
    py.detach(|| quant::dequantize_rows(ggml_type, data, row_stride, ids, out, threads)).map_err(kernel_error)
}

/// One stacked weight of `cpu_gguf_linear` (and the one-call decoder): `(ggml_type, (address,
/// bytes), row_stride, out_features, interleaved)`.
pub(crate) type WeightSpec = (u32, (usize, usize), usize, usize, bool);

/// Whether `cpu_gguf_linear` computes from blocks of the GGML type with this id.
#[pyfunction]
pub fn cpu_gguf_linear_supported(ggml_type: u32) -> bool {
    GgmlType::from_id(ggml_type).is_some_and(quant::matmul::supported)
}

/// `out[rows, Σ out_features] = x[rows, in_features] · [W₀; W₁; …]ᵀ + bias` (float32): the
/// weights stacked along the output features, each `(ggml_type, (address, bytes), row_stride,
/// out_features, interleaved)`, its bytes spanning row 0's first byte to the last row's last, row
/// `n` starting `n * row_stride` bytes in, or (`interleaved`) the rows as `cpu_gguf_interleave`
/// re-laid them. With `residual`, `x` meets the blocks as 8-bit values plus their 8-bit residual
/// (`quant::Activations::Residual`, for the LM head) instead of 8-bit values alone.
#[pyfunction]
#[pyo3(signature = (weights, in_features, x, rows, bias, out, threads, residual=false))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gguf_linear(
    py: Python<'_>,
    weights: Vec<WeightSpec>,
    in_features: usize,
    x: (usize, usize),
    rows: usize,
    bias: Option<(usize, usize)>,
    out: (usize, usize),
    threads: usize,
    residual: bool,
) -> PyResult<()> {
    let mut stacked = Vec::with_capacity(weights.len());
    for (ggml_type, data, row_stride, out_features, interleaved) in weights {
        let Some(ggml_type) = GgmlType::from_id(ggml_type) else {
            return Err(raise("KernelError", format!("GGML type {ggml_type} has no block product")));
        };
        // SAFETY: the caller passes live buffers of these lengths (see the module doc), which
        // nothing writes during the call.
        let data = unsafe { view::<u8>(data) };
        stacked.push(QuantWeight { ggml_type, data, row_stride, out_features, in_features, interleaved });
    }
    // SAFETY: as above; `out` is a fresh tensor aliasing nothing.
    let (x, bias, out) = unsafe { (view::<f32>(x), bias.map(|b| view::<f32>(b)), view_mut::<f32>(out)) };
    let activations = if residual { quant::Activations::Residual } else { quant::Activations::Int8 };
    py.detach(|| quant::matmul_stacked_on(Isa::detect(), activations, &stacked, x, rows, bias, out, threads))
        .map_err(kernel_error)
}

/// Whether the Q4_0/Q4_1/Q8_0 group layout (`ferrollm_kernels::quant::interleaved`) pays for
/// the GGML type with this id on this CPU.
#[pyfunction]
pub fn cpu_gguf_interleave_preferred(ggml_type: u32) -> bool {
    GgmlType::from_id(ggml_type).is_some_and(interleaved::preferred)
}

/// Bytes of an `[out_features, in_features]` weight of the GGML type once interleaved (0 for a
/// type without the layout).
#[pyfunction]
pub fn cpu_gguf_interleaved_len(ggml_type: u32, out_features: usize, in_features: usize) -> usize {
    GgmlType::from_id(ggml_type).map_or(0, |t| interleaved::interleaved_len(t, out_features, in_features))
}

/// Re-lays `out_features` rows of blocks (`rows`: `(address, bytes)`, row `n` at `n *
/// row_stride`) into `dst` (`(address, bytes)`, a fresh buffer of `cpu_gguf_interleaved_len`).
#[pyfunction]
pub fn cpu_gguf_interleave(
    py: Python<'_>,
    ggml_type: u32,
    rows: (usize, usize),
    row_stride: usize,
    out_features: usize,
    in_features: usize,
    dst: (usize, usize),
) -> PyResult<()> {
    let t = type_of(ggml_type)?;
    // SAFETY: the caller passes live buffers of these lengths; `dst` is fresh and aliases nothing.
    let (rows, dst) = unsafe { (view::<u8>(rows), view_mut::<u8>(dst)) };
    py.detach(|| interleaved::interleave(t, rows, row_stride, out_features, in_features, dst))
        .map_err(kernel_error)
}

/// The inverse of `cpu_gguf_interleave`: the rows back to back in `dst` (`out_features` rows of
/// the type's blocks).
#[pyfunction]
pub fn cpu_gguf_deinterleave(
    py: Python<'_>,
    ggml_type: u32,
    src: (usize, usize),
    out_features: usize,
    in_features: usize,
    dst: (usize, usize),
) -> PyResult<()> {
    let t = type_of(ggml_type)?;
    // SAFETY: as in `cpu_gguf_interleave`.
    let (src, dst) = unsafe { (view::<u8>(src), view_mut::<u8>(dst)) };
    py.detach(|| interleaved::deinterleave(t, src, out_features, in_features, dst)).map_err(kernel_error)
}

fn type_of(id: u32) -> PyResult<GgmlType> {
    GgmlType::from_id(id)
        .ok_or_else(|| raise("KernelError", format!("GGML type {id} is not a known block type")))
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
