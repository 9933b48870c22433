//! The CPU kernels (`ferrollm-kernels`) on torch tensors' memory.
//!
//! Tensors cross as `(data_ptr, numel)` pairs plus a dtype name: torch's bfloat16 has no numpy
//! dtype, so the buffer protocol cannot carry it. The one caller, `ferrollm.cpu_kernels`, passes
//! only contiguous CPU tensors of the named dtype, and outputs it has just allocated (so they
//! alias no input). Inputs may be strided where a kernel takes a row stride. The kernels check
//! every length against the shape they are given.

use ferrollm_kernels::attention::{paged_decode, DecodeInputs, DecodeOptions, DecodeShape};
use ferrollm_kernels::cache::{write_kv, write_kv_quantized, CacheWriteShape, KvScales};
use ferrollm_kernels::gemm::{
    gemm, gemm_silu_mul, pack_weight_rows, packed_len, vectorized, GemmShape, RowBlock,
};
use ferrollm_kernels::gemv::{gemv, GemvShape};
use ferrollm_kernels::norm::{fused_add_rms_norm, rms_norm, RmsNormWeight};
use ferrollm_kernels::prefill::{self, paged_prefill, PrefillInputs, PrefillOptions, PrefillShape};
use ferrollm_kernels::rotary::{rotate_neox, RotaryShape};
use ferrollm_kernels::{activation, openmp, Bf16, Fp8E4m3, Fp8E5m2, KernelError};
use pyo3::prelude::*;

use crate::buffers::{view, view_mut, Buffer};
use crate::errors::{kernel_error, raise};

/// Joins the OpenMP runtime at `path`, already loaded in this process (torch's). Raises
/// `KernelError` if it is not loaded or lacks the OpenMP entry points.
#[pyfunction]
pub fn cpu_openmp_attach(py: Python<'_>, path: &str) -> PyResult<()> {
    py.detach(|| openmp::attach(path)).map_err(kernel_error)
}

/// Runs `$body` with `$t` bound to the element type the dtype name stands for.
macro_rules! by_dtype {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            "float32" => {
                type $t = f32;
                $body
            }
            "bfloat16" => {
                type $t = Bf16;
                $body
            }
            other => Err(raise(
                "KernelError",
                format!("`dtype` must be 'float32' or 'bfloat16'. Given: '{other}'"),
            )),
        }
    };
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
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `out` is a fresh tensor.
        let (x, weight, bias, out) = unsafe { (view::<T>(x), view::<T>(weight), bias.map(|b| view::<T>(b)), view_mut::<T>(out)) };
        py.detach(|| gemv(x, weight, bias, out, shape, threads)).map_err(kernel_error)
    })
}

/// Whether `cpu_gemm` runs vectorized (AVX-512) here rather than as a plain loop.
#[pyfunction]
pub fn cpu_gemm_vectorized() -> bool {
    vectorized()
}

/// Elements `cpu_gemm_pack` writes for an `[out_features, in_features]` weight.
#[pyfunction]
pub fn cpu_gemm_packed_len(out_features: usize, in_features: usize) -> usize {
    packed_len(out_features, in_features)
}

/// Packs rows `first_row..first_row + rows` of an fp32 `[out_features, in_features]` weight,
/// row `r` of them at element `r * stride` of `weight`, into their columns of `packed` for
/// `cpu_gemm`; the rest of `packed` is left as it is.
#[pyfunction]
#[pyo3(signature = (weight, packed, out_features, in_features, first_row, rows, stride, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemm_pack(
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
    let (weight, packed) = unsafe { (view::<f32>(weight), view_mut::<f32>(packed)) };
    let block = RowBlock { first: first_row, rows, stride };
    py.detach(|| pack_weight_rows(weight, block, packed, out_features, in_features, threads))
        .map_err(kernel_error)
}

/// `out[rows, out_features] = x[rows, in_features] · weightᵀ + bias` in fp32, the weight packed
/// by `cpu_gemm_pack`.
#[pyfunction]
#[pyo3(signature = (x, packed, bias, out, rows, out_features, in_features, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemm(
    py: Python<'_>,
    x: Buffer,
    packed: Buffer,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> PyResult<()> {
    packed_product(py, gemm, [x, packed], bias, out, GemmShape { rows, out_features, in_features }, threads)
}

/// `out[rows, width] = silu(x · w_gateᵀ + b_gate) · (x · w_upᵀ + b_up)` in fp32, `packed` holding
/// `w_gate` then `w_up`, each packed by `cpu_gemm_pack`.
#[pyfunction]
#[pyo3(signature = (x, packed, bias, out, rows, width, in_features, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_gemm_silu_mul(
    py: Python<'_>,
    x: Buffer,
    packed: Buffer,
    bias: Option<Buffer>,
    out: Buffer,
    rows: usize,
    width: usize,
    in_features: usize,
    threads: usize,
) -> PyResult<()> {
    let shape = GemmShape { rows, out_features: width, in_features };
    packed_product(py, gemm_silu_mul, [x, packed], bias, out, shape, threads)
}

/// The signature [`gemm`] and [`gemm_silu_mul`] share.
type PackedKernel =
    fn(&[f32], &[f32], Option<&[f32]>, &mut [f32], GemmShape, usize) -> Result<(), KernelError>;

/// Runs `kernel` on `x` and `packed` off the GIL.
fn packed_product(
    py: Python<'_>,
    kernel: PackedKernel,
    [x, packed]: [Buffer; 2],
    bias: Option<Buffer>,
    out: Buffer,
    shape: GemmShape,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let (x, packed, bias, out) =
        unsafe { (view::<f32>(x), view::<f32>(packed), bias.map(|b| view::<f32>(b)), view_mut::<f32>(out)) };
    py.detach(|| kernel(x, packed, bias, out, shape, threads)).map_err(kernel_error)
}

/// Runs `$body` with `$c` bound to the KV cache's element type: `$t` for `None`, else the fp8
/// format torch's dtype name stands for.
macro_rules! by_cache_dtype {
    ($cache_dtype:expr, $t:ident, $c:ident => $body:expr) => {
        match $cache_dtype {
            None => {
                type $c = $t;
                $body
            }
            Some("float8_e4m3fn") => {
                type $c = Fp8E4m3;
                $body
            }
            Some("float8_e5m2") => {
                type $c = Fp8E5m2;
                $body
            }
            Some(other) => Err(raise(
                "KernelError",
                format!("`cache_dtype` must be None, 'float8_e4m3fn' or 'float8_e5m2'. Given: '{other}'"),
            )),
        }
    };
}

/// `out[row, head] = attention(query[row, head], row's first seq_lens[row] cached tokens)`; an
/// fp8 cache (`cache_dtype`) is read as its values times `k_scale` / `v_scale`.
#[pyfunction]
#[pyo3(signature = (dtype, query, key_cache, value_cache, block_tables, seq_lens, out, num_heads,
                    num_kv_heads, head_dim, block_size, max_blocks_per_seq, scale, threads,
                    sliding_window=None, soft_cap=None, cache_dtype=None, k_scale=1.0, v_scale=1.0))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_paged_decode(
    py: Python<'_>,
    dtype: &str,
    query: Buffer,
    key_cache: Buffer,
    value_cache: Buffer,
    block_tables: Buffer,
    seq_lens: Buffer,
    out: Buffer,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    max_blocks_per_seq: usize,
    scale: f32,
    threads: usize,
    sliding_window: Option<usize>,
    soft_cap: Option<f32>,
    cache_dtype: Option<&str>,
    k_scale: f32,
    v_scale: f32,
) -> PyResult<()> {
    let shape = DecodeShape { num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq };
    let options = DecodeOptions { scale, sliding_window, soft_cap };
    let scales = KvScales { key: k_scale, value: v_scale };
    by_dtype!(dtype, T => by_cache_dtype!(cache_dtype, T, C => {
        // SAFETY: see the module doc; `out` is a fresh tensor.
        let (inputs, out) = unsafe {
            let inputs = DecodeInputs::<T, C> {
                query: view(query), key_cache: view(key_cache), value_cache: view(value_cache),
                block_tables: view(block_tables), seq_lens: view(seq_lens), scales,
            };
            (inputs, view_mut::<T>(out))
        };
        py.detach(|| paged_decode(inputs, shape, options, out, threads)).map_err(kernel_error)
    }))
}

/// Whether `cpu_paged_prefill` runs on this CPU for this head size.
#[pyfunction]
pub fn cpu_paged_prefill_supported(head_dim: usize) -> bool {
    prefill::supports(head_dim)
}

/// Causal attention of one request's query chunk over its paged context.
#[pyfunction]
#[pyo3(signature = (dtype, query, key_cache, value_cache, block_table, out, num_heads, num_kv_heads,
                    head_dim, block_size, query_len, num_computed, scale, threads, sliding_window=None))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_paged_prefill(
    py: Python<'_>,
    dtype: &str,
    query: Buffer,
    key_cache: Buffer,
    value_cache: Buffer,
    block_table: Buffer,
    out: Buffer,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    query_len: usize,
    num_computed: usize,
    scale: f32,
    threads: usize,
    sliding_window: Option<usize>,
) -> PyResult<()> {
    let shape = PrefillShape { num_heads, num_kv_heads, head_dim, block_size, query_len, num_computed };
    let options = PrefillOptions { scale, sliding_window };
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `out` is a fresh tensor.
        let (inputs, out) = unsafe {
            let inputs = PrefillInputs::<T> {
                query: view(query), key_cache: view(key_cache), value_cache: view(value_cache),
                block_table: view(block_table),
            };
            (inputs, view_mut::<T>(out))
        };
        py.detach(|| paged_prefill(inputs, shape, options, out, threads)).map_err(kernel_error)
    })
}

/// `out = rms_norm(x)`, or with `residual`: `residual_out = x + residual; out = rms_norm(residual_out)`.
#[pyfunction]
#[pyo3(signature = (dtype, x, weight, eps, gemma, out, threads, residual=None, residual_out=None))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_rms_norm(
    py: Python<'_>,
    dtype: &str,
    x: Buffer,
    weight: Buffer,
    eps: f32,
    gemma: bool,
    out: Buffer,
    threads: usize,
    residual: Option<Buffer>,
    residual_out: Option<Buffer>,
) -> PyResult<()> {
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `out` and `residual_out` are fresh tensors.
        let (x, weight, out) = unsafe { (view::<T>(x), view::<T>(weight), view_mut::<T>(out)) };
        let norm = RmsNormWeight { weight, eps, gemma };
        match (residual, residual_out) {
            (Some(r), Some(r_out)) => {
                // SAFETY: as above.
                let (r, r_out) = unsafe { (view::<T>(r), view_mut::<T>(r_out)) };
                py.detach(|| fused_add_rms_norm(x, r, norm, out, r_out, threads)).map_err(kernel_error)
            }
            (None, None) => py.detach(|| rms_norm(x, norm, out, threads)).map_err(kernel_error),
            _ => Err(raise("KernelError", "`residual` and `residual_out` must be given together".to_owned())),
        }
    })
}

/// `out[r] = silu(x[r, :width]) * x[r, width:]`.
#[pyfunction]
pub fn cpu_silu_and_mul(
    py: Python<'_>,
    dtype: &str,
    x: Buffer,
    width: usize,
    out: Buffer,
    threads: usize,
) -> PyResult<()> {
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `out` is a fresh tensor.
        let (x, out) = unsafe { (view::<T>(x), view_mut::<T>(out)) };
        py.detach(|| activation::silu_and_mul(x, width, out, threads)).map_err(kernel_error)
    })
}

/// `out` = the first `heads` heads of each `row_stride`-long row of `x`, rotated (NeoX style) by
/// the `cos_sin` rows at `positions` (int64).
#[pyfunction]
#[pyo3(signature = (dtype, x, positions, cos_sin, out, rows, row_stride, heads, head_size, rotary_dim, threads))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_rotary_neox(
    py: Python<'_>,
    dtype: &str,
    x: Buffer,
    positions: Buffer,
    cos_sin: Buffer,
    out: Buffer,
    rows: usize,
    row_stride: usize,
    heads: usize,
    head_size: usize,
    rotary_dim: usize,
    threads: usize,
) -> PyResult<()> {
    let shape = RotaryShape { rows, row_stride, heads, head_size, rotary_dim };
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `x` may be a strided view, `out` is a fresh tensor.
        let (x, positions, cos_sin, out) =
            unsafe { (view::<T>(x), view::<i64>(positions), view::<T>(cos_sin), view_mut::<T>(out)) };
        py.detach(|| rotate_neox(x, positions, cos_sin, out, shape, threads)).map_err(kernel_error)
    })
}

/// Writes token `i`'s keys and values (rows `key_stride`/`value_stride` apart) to slot
/// `slot_mapping[i]` of the key and value caches (`[slots, width]` each).
#[pyfunction]
#[pyo3(signature = (dtype, key, value, slot_mapping, key_cache, value_cache, tokens, width, key_stride, value_stride))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_write_kv(
    py: Python<'_>,
    dtype: &str,
    key: Buffer,
    value: Buffer,
    slot_mapping: Buffer,
    key_cache: Buffer,
    value_cache: Buffer,
    tokens: usize,
    width: usize,
    key_stride: usize,
    value_stride: usize,
) -> PyResult<()> {
    let shape = CacheWriteShape { tokens, width, key_stride, value_stride };
    by_dtype!(dtype, T => {
        // SAFETY: see the module doc; `key`/`value` may be strided views, the caches are the two
        // disjoint halves of one layer's cache, which no input aliases.
        let (key, value, slots, key_cache, value_cache) = unsafe {
            (view::<T>(key), view::<T>(value), view::<i64>(slot_mapping), view_mut::<T>(key_cache), view_mut::<T>(value_cache))
        };
        py.detach(|| write_kv(key, value, slots, key_cache, value_cache, shape)).map_err(kernel_error)
    })
}

/// [`cpu_write_kv`] into an fp8 cache (`cache_dtype`): each element stored as `x / k_scale`
/// (keys) or `x / v_scale` (values), rounded to nearest even and saturated.
#[pyfunction]
#[pyo3(signature = (dtype, cache_dtype, key, value, slot_mapping, key_cache, value_cache, tokens, width,
                    key_stride, value_stride, k_scale, v_scale))]
#[allow(clippy::too_many_arguments)]
pub fn cpu_write_kv_quantized(
    py: Python<'_>,
    dtype: &str,
    cache_dtype: &str,
    key: Buffer,
    value: Buffer,
    slot_mapping: Buffer,
    key_cache: Buffer,
    value_cache: Buffer,
    tokens: usize,
    width: usize,
    key_stride: usize,
    value_stride: usize,
    k_scale: f32,
    v_scale: f32,
) -> PyResult<()> {
    let shape = CacheWriteShape { tokens, width, key_stride, value_stride };
    let scales = KvScales { key: k_scale, value: v_scale };
    by_dtype!(dtype, T => by_cache_dtype!(Some(cache_dtype), T, C => {
        // SAFETY: as in `cpu_write_kv`.
        let (key, value, slots, key_cache, value_cache) = unsafe {
            (view::<T>(key), view::<T>(value), view::<i64>(slot_mapping), view_mut::<C>(key_cache), view_mut::<C>(value_cache))
        };
        py.detach(|| write_kv_quantized(key, value, slots, key_cache, value_cache, shape, scales)).map_err(kernel_error)
    }))
}

/// `out[r]` (int64), a token drawn from row `r` of `logits` (`[rows, vocab]` float32) with
/// probability `softmax(logits[r])`, at the uniform number `uniforms[r]` (float64, in [0, 1)).
#[pyfunction]
pub fn cpu_sample_rows(
    py: Python<'_>,
    logits: Buffer,
    vocab: usize,
    uniforms: Buffer,
    out: Buffer,
    threads: usize,
) -> PyResult<()> {
    // SAFETY: see the module doc; `out` is a fresh tensor.
    let (logits, uniforms, out) =
        unsafe { (view::<f32>(logits), view::<f64>(uniforms), view_mut::<i64>(out)) };
    py.detach(|| ferrollm_kernels::sample::sample_rows(logits, vocab, uniforms, out, threads))
        .map_err(kernel_error)
}
