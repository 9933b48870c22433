//! GGUF block decoding (`ferrollm_kernels::quant`) on numpy/torch memory.
//!
//! Buffers cross as `(address, length)` pairs, as in `cpu_kernels`: `data` is a tensor's bytes
//! (usually a view of the memory-mapped file), `out` a contiguous float32 or bfloat16 tensor the
//! caller has just allocated. The one caller is `ferrollm.kernels.cpu.gguf`.

use ferrollm_kernels::quant::{dequantize, GgmlType};
use ferrollm_kernels::{Bf16, Element};
use pyo3::prelude::*;

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

fn run<T: Element>(
    py: Python<'_>,
    ggml_type: GgmlType,
    data: (usize, usize),
    out: (usize, usize),
    threads: usize,
) -> PyResult<()> {
    // SAFETY: the caller passes live buffers of these lengths (see the module doc); `out` is a
    // fresh tensor of `T`, aliasing nothing, and nothing writes `data` during the call.
    let (data, out) = unsafe { (slice::<u8>(data), slice_mut::<T>(out)) };
    py.detach(|| dequantize(ggml_type, data, out, threads)).map_err(kernel_error)
}

/// # Safety
/// `buf` must address `buf.1` initialised, live `T`s that nothing writes during the call.
unsafe fn slice<'a, T>(buf: (usize, usize)) -> &'a [T] {
    if buf.1 == 0 {
        return &[];
    }
    std::slice::from_raw_parts(buf.0 as *const T, buf.1)
}

/// # Safety
/// As [`slice`], and nothing else reads or writes them during the call.
unsafe fn slice_mut<'a, T>(buf: (usize, usize)) -> &'a mut [T] {
    if buf.1 == 0 {
        return &mut [];
    }
    std::slice::from_raw_parts_mut(buf.0 as *mut T, buf.1)
}
