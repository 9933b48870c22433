//! The quantized CPU linear layers (`ferrollm_kernels::quant`: weight-only int4/int8, W8A8
//! int8, fp8 e4m3) on torch tensors' memory.
//!
//! Buffers cross as `(data_ptr, numel)` pairs, as in `cpu_kernels`. The one caller,
//! `ferrollm.kernels.cpu.quant`, passes contiguous CPU tensors of the dtypes each function
//! names, and outputs it has just allocated (so they alias no input); the kernels check every
//! length against the shape they are given.

use ferrollm_kernels::quant::fp8::{fp8_linear, Fp8Input, Fp8Scale, Fp8Shape, Fp8Weight};
use ferrollm_kernels::quant::w8a8::{
    w8a8_linear, w8a8_pack, w8a8_packed_len, ActQuant, W8a8Shape, W8a8Weight,
};
use ferrollm_kernels::quant::wq::{int4_packed_len, pack_int4, wq_linear, QWeight, WqShape, WqWeight};
use pyo3::prelude::*;

use crate::buffers::{view, view_mut, Buffer};
use crate::errors::{kernel_error, raise};

/// Adds this module's functions to `_core`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(cpu_wq_int4_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_wq_pack_int4, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_wq_linear, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_w8a8_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_w8a8_pack, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_w8a8_linear, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_fp8_linear, m)?)?;
    Ok(())
}

/// Bytes `cpu_wq_pack_int4` writes for an `[out_features, in_features]` weight.
#[pyfunction]
pub fn cpu_wq_int4_packed_len(out_features: usize, in_features: usize) -> usize {
    int4_packed_len(out_features, in_features)
}

/// Packs `q` (uint8 `[out_features, in_features]`, values 0..=15) into `packed` (uint8,
/// `cpu_wq_int4_packed_len` bytes) for `cpu_wq_linear`.
#[pyfunction]
#[pyo3(signature = (q, packed, out_features, in_features, threads))]
pub fn cpu_wq_pack_int4(
    py: Python<'_>,
    q: Buffer,
    packed: Buffer,
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `packed` is a fresh tensor.
    let (q, packed) = unsafe { (view::<u8>(q), view_mut::<u8>(packed)) };
    py.detach(|| pack_int4(q, packed, out_features, in_features, threads)).map_err(kernel_error)
}

/// `out[rows, out_features] = x · wᵀ + bias` in float32 for the weight-only quantized `w`:
/// `qweight` packed int4 (`bits=4`, uint8) or int8 (`bits=8`), `scales` and `mins` float32
/// `[out_features, in_features / group_size]`.
#[pyfunction]
#[pyo3(signature = (x, qweight, bits, scales, mins, bias, out, rows, out_features, in_features, group_size, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_wq_linear(
    py: Python<'_>,
    x: Buffer,
    qweight: Buffer,
    bits: u32,
    scales: Buffer,
    mins: Option<Buffer>,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    group_size: usize,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let q = unsafe {
        match bits {
            4 => QWeight::Int4(view::<u8>(qweight)),
            8 => QWeight::Int8(view::<i8>(qweight)),
            other => return Err(raise("KernelError", format!("`bits` must be 4 or 8. Given: {other}"))),
        }
    };
    // SAFETY: as above.
    let (x, scales, mins, bias, out) = unsafe {
        (
            view::<f32>(x),
            view::<f32>(scales),
            mins.map(|m| view::<f32>(m)),
            bias.map(|b| view::<f32>(b)),
            view_mut::<f32>(out),
        )
    };
    let weight = WqWeight { q, scales, mins };
    let shape = WqShape { rows, out_features, in_features, group_size };
    py.detach(|| wq_linear(x, weight, bias, out, shape, threads)).map_err(kernel_error)
}

/// Bytes `cpu_w8a8_pack` writes for an `[out_features, in_features]` weight.
#[pyfunction]
pub fn cpu_w8a8_packed_len(out_features: usize, in_features: usize) -> usize {
    w8a8_packed_len(out_features, in_features)
}

/// Packs `qweight` (int8 `[out_features, in_features]`) into `packed` (uint8,
/// `cpu_w8a8_packed_len` bytes) for `cpu_w8a8_linear`.
#[pyfunction]
#[pyo3(signature = (qweight, packed, out_features, in_features, threads))]
pub fn cpu_w8a8_pack(
    py: Python<'_>,
    qweight: Buffer,
    packed: Buffer,
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `packed` is a fresh tensor.
    let (q, packed) = unsafe { (view::<i8>(qweight), view_mut::<u8>(packed)) };
    py.detach(|| w8a8_pack(q, packed, out_features, in_features, threads)).map_err(kernel_error)
}

/// `out[rows, out_features]` of the W8A8 product: activations quantized per token (no
/// `input_scale`) or with the given scale and zero point, `weight_scale` float32 `[out_features]`.
#[pyfunction]
#[pyo3(signature = (x, packed, weight_scale, bias, out, rows, out_features, in_features, input_scale, input_zero_point, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_w8a8_linear(
    py: Python<'_>,
    x: Buffer,
    packed: Buffer,
    weight_scale: Buffer,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    input_scale: Option<f32>,
    input_zero_point: i32,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let (x, packed, weight_scale, bias, out) = unsafe {
        (
            view::<f32>(x),
            view::<u8>(packed),
            view::<f32>(weight_scale),
            bias.map(|b| view::<f32>(b)),
            view_mut::<f32>(out),
        )
    };
    let act = match input_scale {
        None => ActQuant::Dynamic,
        Some(scale) => ActQuant::Static { scale, zero_point: input_zero_point },
    };
    let shape = W8a8Shape { rows, out_features, in_features };
    let weight = W8a8Weight { packed, weight_scale };
    py.detach(|| w8a8_linear(x, weight, bias, act, out, shape, threads)).map_err(kernel_error)
}

/// `out[rows, out_features] = xq · wᵀ + bias` for e4m3fn `weight` bytes scaled per tensor
/// (`scale_kind` 'tensor', one scale), per output feature ('channel') or per `block`
/// ('block'); `input_quant` is 'none', 'tensor', 'static' (with `input_scale`) or 'group'.
#[pyfunction]
#[pyo3(signature = (x, weight, weight_scale, scale_kind, block, bias, out, rows, out_features, in_features, input_quant, input_scale, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_fp8_linear(
    py: Python<'_>,
    x: Buffer,
    weight: Buffer,
    weight_scale: Buffer,
    scale_kind: &str,
    block: Option<(usize, usize)>,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    input_quant: &str,
    input_scale: Option<f32>,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let (x, bytes, scales, bias, out) = unsafe {
        (
            view::<f32>(x),
            view::<u8>(weight),
            view::<f32>(weight_scale),
            bias.map(|b| view::<f32>(b)),
            view_mut::<f32>(out),
        )
    };
    let scale = match (scale_kind, block) {
        ("tensor", _) if scales.len() == 1 => Fp8Scale::Tensor(scales[0]),
        ("channel", _) => Fp8Scale::Channel(scales),
        ("block", Some((bo, bi))) => Fp8Scale::Block { scales, bo, bi },
        _ => {
            let msg = format!("`scale_kind` must be 'tensor' (one scale), 'channel' or 'block' (with `block`). Given: '{scale_kind}'");
            return Err(raise("KernelError", msg));
        }
    };
    let input = match (input_quant, input_scale) {
        ("none", _) => Fp8Input::None,
        ("tensor", _) => Fp8Input::Tensor,
        ("static", Some(s)) => Fp8Input::Static(s),
        ("group", _) => Fp8Input::Group,
        _ => {
            let msg = format!("`input_quant` must be 'none', 'tensor', 'static' (with `input_scale`) or 'group'. Given: '{input_quant}'");
            return Err(raise("KernelError", msg));
        }
    };
    let shape = Fp8Shape { rows, out_features, in_features };
    let weight = Fp8Weight { bytes, scale };
    py.detach(|| fp8_linear(x, weight, bias, input, out, shape, threads)).map_err(kernel_error)
}
