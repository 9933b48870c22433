//! CPU kernels for the model runner's decode steps, on plain slices.
//!
//! A decode step with few rows multiplies every weight by one to a few activation rows, so it is
//! bound by how fast the weights stream from memory. oneDNN and MKL reach ~20 GB/s there on the
//! 2-core development machine, whose memory gives ~27 GB/s to a plain sum: [`gemv`] gets there.
//!
//! The kernels split rows over the OpenMP team of the process they live in ([`openmp`]), the
//! same threads torch runs its ops on, instead of a pool of their own: two pools on the same cores
//! take turns spinning, and the kernels lose more than they gain.
//!
//! Elements are `f32` or [`Bf16`]; arithmetic is `f32`. Every entry point checks the sizes it
//! is given and returns [`KernelError`] rather than panicking, since callers pass buffers across
//! an FFI.

mod element;
mod error;
pub mod gemv;
pub mod openmp;
mod simd;

pub use element::{Bf16, Element};
pub use error::KernelError;
