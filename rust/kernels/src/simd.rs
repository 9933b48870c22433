//! AVX2/FMA pieces of the kernels, and the runtime check that lets them run.
//!
//! The wheel targets baseline x86-64 so it loads on any machine; [`has_avx2_fma`] says once
//! whether this CPU has the instructions, and the kernels fall back to plain loops when not.
//! AVX2 rather than AVX-512: the kernels are bound by memory, not arithmetic, and AVX2 keeps the
//! crate on the workspace's minimum Rust (AVX-512 intrinsics are stable from 1.89).

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

/// Whether the AVX2/FMA paths may run on this CPU.
pub(crate) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::element::{Bf16, Element};

    /// An element type that loads eight at a time into f32 lanes. Public but unnameable outside
    /// the crate (`simd` is private): it seals `gemv::Weight` to the types implemented here.
    pub trait Lanes: Element {
        /// # Safety
        /// `ptr` must address eight readable elements, and the CPU must have AVX2.
        unsafe fn load8(ptr: *const Self) -> __m256;
    }

    impl Lanes for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load8(ptr: *const Self) -> __m256 {
            _mm256_loadu_ps(ptr)
        }
    }

    impl Lanes for Bf16 {
        /// bf16 is the top half of an f32: widen each 16-bit lane and shift it up.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load8(ptr: *const Self) -> __m256 {
            let halves = _mm_loadu_si128(ptr.cast::<__m128i>());
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }
    }

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn sum8(v: __m256) -> f32 {
        let quad = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps::<1>(pair, pair)))
    }
}
