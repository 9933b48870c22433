//! CPU kernels for the model runner's hot path, on plain slices.
//!
//! - [`gemv`]: a decode step with few rows multiplies every weight by one or two activation rows,
//!   so it is bound by how fast the weights stream from memory. oneDNN and MKL reach ~20 GB/s
//!   there on the 2-core development machine, whose memory gives ~27-31 GB/s to a plain sum;
//!   this kernel gets there.
//! - [`gemm`]: the fp32 product for two rows and more, on weights packed once into column panels,
//!   8 rows × 48 columns in registers, chunks of the panel held in L1. From a few rows on the
//!   products are bound by the multiply-adds; it beats oneDNN's packed GEMM by 10-30% at decode
//!   batch sizes, and at two rows its contiguous panels stream faster than the GEMV.
//! - [`gemm_bf16`]: the same product from a bf16 weight packed once into panels of column pairs,
//!   summed in f32: AVX512-BF16 dot products, or bf16 widened in registers (AVX-512F, AVX2); on
//!   the AVX2 machine as fast per core as oneDNN's fp32 GEMM from 8 rows on, at half the bytes.
//! - [`norm`], [`activation`], [`rotary`], [`attention`]: each does in one call what the torch
//!   path does in a chain of small ops (RMSNorm with the residual add, `silu(gate) * up`, NeoX
//!   rotary in place, paged decode attention read straight from the block table). At a few rows
//!   the chain's cost is its dispatches: ~0.5 ms per layer of a batch-1 Qwen2-0.5B step.
//! - [`prefill`]: a prompt's causal attention over its paged context, flash-attention style, on
//!   AVX-512 CPUs; ~3x torch's fused attention, which needed the context gathered out first.
//! - [`cache`]: the step's keys and values into their KV cache slots, for the same reason.
//! - [`quant`]: GGUF's block formats (Q4_0 to Q8_0, Q4_K to Q6_K, f16, bf16) to floats, one
//!   block-decoding function per format, for loading llama.cpp files; and the linear layers of
//!   the dense quantized formats (weight-only int4/int8, W8A8 int8, fp8), which compute from
//!   the packed weights.
//!
//! - [`decoder`]: a decode step through a whole stack of Llama-shaped layers in one call, the
//!   kernels above back to back, so a batch-1 step on quantized weights does not spend half its
//!   time in the Python glue between them.
//!
//! The kernels split rows over the OpenMP team of the process they live in ([`openmp`]), the
//! same threads torch runs its ops on, instead of a pool of their own: two pools on the same cores
//! take turns spinning, and the kernels lose more than they gain.
//!
//! Elements are `f32` or [`Bf16`]; arithmetic is `f32`. Every entry point checks the sizes it
//! is given and returns [`KernelError`] rather than panicking, since callers pass buffers across
//! an FFI.

pub mod activation;
pub mod attention;
pub mod cache;
pub mod decoder;
mod element;
mod error;
pub mod gemm;
pub mod gemm_bf16;
pub mod gemv;
pub mod norm;
pub mod openmp;
mod paged;
pub mod prefill;
pub mod quant;
pub mod rotary;
pub mod sample;
mod simd;
#[cfg(test)]
mod test_support;

pub use element::{Bf16, Element, Fp8E4m3, Fp8E5m2};
pub use error::KernelError;
pub use simd::SimdElement;
