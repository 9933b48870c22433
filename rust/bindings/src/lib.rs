//! `ferrollm._core`: the PyO3 bindings of `ferrollm-core`. Type conversion only; the GIL is
//! released around every call that does work. `python/ferrollm/_core.pyi` is this module's
//! contract and `make test` checks the two agree (mypy.stubtest).

mod broadcast;
mod buffers;
mod cpu_kernels;
mod decoder;
mod engine;
mod errors;
mod gemm_bf16;
mod gguf;
mod mm_cache;
mod outputs;
mod quant_kernels;
mod sampling;
mod tokenizer;

use pyo3::prelude::*;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<engine::PyEngineCore>()?;
    m.add_class::<sampling::PySamplingOptions>()?;
    m.add_class::<tokenizer::PyTokenizer>()?;
    m.add_class::<outputs::PySchedulerOutput>()?;
    m.add_class::<outputs::PyNewRequestData>()?;
    m.add_class::<outputs::PyRequestOutput>()?;
    m.add_class::<broadcast::PyStepBroadcaster>()?;
    m.add_class::<broadcast::PyStepReceiver>()?;
    m.add_class::<mm_cache::PyMultiModalCache>()?;
    m.add_class::<decoder::PyCpuDecoder>()?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_openmp_attach, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemm_pack, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemm_packed_len, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemm_silu_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_gemm_vectorized, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_write_kv, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_write_kv_quantized, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_paged_decode, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_paged_prefill_supported, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_paged_prefill, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_silu_and_mul, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_rotary_neox, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_kernels::cpu_sample_rows, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_supported, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_dequantize, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_embedding, m)?)?;
    quant_kernels::register(m)?;
    gemm_bf16::register(m)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_linear_supported, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_linear, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_interleave_preferred, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_interleaved_len, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_interleave, m)?)?;
    m.add_function(wrap_pyfunction!(gguf::cpu_gguf_deinterleave, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
