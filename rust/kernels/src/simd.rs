//! SIMD pieces of the kernels, and the runtime checks that let them run.
//!
//! The wheel targets baseline x86-64 so it loads on any machine; [`has_avx2_fma`] and
//! [`has_avx512f`] say once whether this CPU has the instructions. The GEMV and the AVX2 decode
//! attention use AVX2 through intrinsics (module `x86`, whose [`Lanes`] loads 8 or 16 elements
//! as f32); the GEMM and the AVX-512 attention kernels use AVX-512 intrinsics in their own
//! modules; the other kernels are loops written so LLVM vectorizes them (fixed-width lane arrays,
//! no branches), compiled again for AVX-512 and for AVX2/FMA by [`multiversion`].

use crate::element::Element;

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::*;

/// An element type the vectorized kernels load (`f32` and [`crate::Bf16`]); sealed, since the
/// loads are written per type.
#[cfg(target_arch = "x86_64")]
pub trait SimdElement: Lanes {}
#[cfg(target_arch = "x86_64")]
impl<T: Lanes> SimdElement for T {}
/// An element type the vectorized kernels load.
#[cfg(not(target_arch = "x86_64"))]
pub trait SimdElement: Element {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: Element> SimdElement for T {}

/// Lanes of one accumulator array: two AVX2 registers of f32, so two FMA chains are in flight.
const LANES: usize = 16;

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

/// Whether the AVX-512 paths may run on this CPU.
pub(crate) fn has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && has_avx2_fma())
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU is AMD's: its L3 is a victim cache of L2, which decides how a kernel
/// streaming a weight from memory asks for it ahead (see `gemm`'s one-row product).
pub(crate) fn is_amd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static AMD: OnceLock<bool> = OnceLock::new();
        *AMD.get_or_init(|| {
            let id = std::arch::x86_64::__cpuid(0);
            [id.ebx, id.edx, id.ecx].map(u32::to_le_bytes).concat() == b"AuthenticAMD"
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::element::Bf16;
    use crate::Element;

    /// An element type that loads eight at a time into f32 lanes. Public but unnameable outside
    /// the crate (`simd` is private): it seals `gemv::Weight` to the types implemented here.
    pub trait Lanes: Element {
        /// Whether a load does more than widen (fp8's shifts and multiply): kernels that read
        /// the same row once per query head then widen it once into f32 and read that instead.
        const WIDENS: bool = false;
        /// # Safety
        /// `ptr` must address eight readable elements, and the CPU must have AVX2.
        unsafe fn load8(ptr: *const Self) -> __m256;
        /// # Safety
        /// `ptr` must address sixteen readable elements, and the CPU must have AVX-512F.
        unsafe fn load16(ptr: *const Self) -> __m512;
    }

    impl Lanes for f32 {
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load8(ptr: *const Self) -> __m256 {
            _mm256_loadu_ps(ptr)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const Self) -> __m512 {
            _mm512_loadu_ps(ptr)
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
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const Self) -> __m512 {
            let halves = _mm256_loadu_si256(ptr.cast::<__m256i>());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
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

/// Defines `$name`, calling `$body` (an `#[inline(always)]` generic function) through its
/// AVX-512 or AVX2/FMA compilation when the CPU has it. The loops vectorize to 16 lanes under
/// AVX-512: SiLU-and-mul, whose exponential and division are the work, ran ~2x as fast.
macro_rules! multiversion {
    (fn $name:ident<$t:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        #[inline]
        fn $name<$t: Element>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn widest<$t: Element>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$t>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide<$t: Element>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$t>($($arg),*)
                }
                if crate::simd::has_avx512f() {
                    // SAFETY: the CPU has every feature `widest` was compiled for.
                    return unsafe { widest::<$t>($($arg),*) };
                }
                if crate::simd::has_avx2_fma() {
                    // SAFETY: the CPU has every feature `wide` was compiled for.
                    return unsafe { wide::<$t>($($arg),*) };
                }
            }
            $body::<$t>($($arg),*)
        }
    };
    // Two element types: the first is the output's, the second the one read (an fp8 cache).
    ($vis:vis fn $name:ident<$t:ident, $c:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $body:ident) => {
        #[inline]
        $vis fn $name<$t: Element, $c: Element>($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn widest<$t: Element, $c: Element>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$t, $c>($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn wide<$t: Element, $c: Element>($($arg: $ty),*) $(-> $ret)? {
                    $body::<$t, $c>($($arg),*)
                }
                if crate::simd::has_avx512f() {
                    // SAFETY: the CPU has every feature `widest` was compiled for.
                    return unsafe { widest::<$t, $c>($($arg),*) };
                }
                if crate::simd::has_avx2_fma() {
                    // SAFETY: the CPU has every feature `wide` was compiled for.
                    return unsafe { wide::<$t, $c>($($arg),*) };
                }
            }
            $body::<$t, $c>($($arg),*)
        }
    };
}
pub(crate) use multiversion;

/// Asks for the cache lines of `data` ahead of use. Context rows are scattered over the cache's
/// blocks and each is used briefly, so without this a decode unit waits on memory for every row
/// (measured: ~1.6 GB/s read, against ~5 GB/s for torch's gather of the same rows).
#[inline(always)]
pub(crate) fn prefetch<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<T, { std::arch::x86_64::_MM_HINT_T0 }>(data);
}

/// [`prefetch`] into L2 only. A core has few L1 miss buffers, and a software prefetch waits for
/// one: a burst of L1 prefetches stalls the core, where L2 takes more misses in flight and an L1
/// miss that finds the line in L2 is short.
#[inline(always)]
pub(crate) fn prefetch_l2<T>(data: &[T]) {
    #[cfg(target_arch = "x86_64")]
    prefetch_lines::<T, { std::arch::x86_64::_MM_HINT_T1 }>(data);
}

/// How far ahead of its read position a kernel streaming a weight from memory asks for lines.
/// The hardware prefetchers stop at each 4 KiB page and kept too few lines in flight for one
/// thread's contiguous run: batch-1 decode of Qwen2-0.5B Q4_0 went from 47.3 to 53.7 tok/s with
/// this (2 threads, Xeon VM; 2 and 8 KiB measured the same within noise).
pub(crate) const STREAM_AHEAD: usize = 4096;

/// Asks for the cache lines of the `bytes` from `at`, an address that may lie past any buffer
/// (a prefetch never faults): what a streaming kernel reads [`STREAM_AHEAD`] bytes from now.
#[inline(always)]
pub(crate) fn prefetch_stream(at: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let mut offset = 0;
        while offset < bytes {
            // SAFETY: prefetching is a hint; it never faults, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    at.wrapping_add(offset).cast(),
                )
            };
            offset += 64;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_lines<T, const HINT: i32>(data: &[T]) {
    const LINE: usize = 64;
    let start = data.as_ptr() as usize;
    let end = start + std::mem::size_of_val(data);
    let mut line = start & !(LINE - 1);
    while line < end {
        // SAFETY: prefetching is a hint; it never faults, whatever the address.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(line as *const i8) };
        line += LINE;
    }
}

/// `dst[i] = src[i]` as f32.
#[inline(always)]
pub(crate) fn load<T: Element>(src: &[T], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// Sum of the lanes, pairwise (a few shuffles) rather than 15 dependent scalar adds, which cost
/// more than the 64-element dot product they end.
#[inline(always)]
fn reduce(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `sum(a[i]^2)` of elements of `T`.
#[inline(always)]
pub(crate) fn sum_squares<T: Element>(a: &[T]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let body = a.len() / LANES * LANES;
    for x in a[..body].chunks_exact(LANES) {
        for i in 0..LANES {
            let v = x[i].to_f32();
            acc[i] += v * v;
        }
    }
    let tail: f32 = a[body..].iter().map(|x| x.to_f32() * x.to_f32()).sum();
    reduce(acc) + tail
}

/// `y[i] += alpha * x[i]`.
#[inline(always)]
pub(crate) fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * *x;
    }
}

/// ln 2 split in two for the range reduction of [`exp`] (and of the AVX-512 prefill's
/// exponential): `LN2_HI` has few enough mantissa bits that `n * LN2_HI` is exact for the `n`
/// an f32 exponent can take, and `LN2_LO` carries the rest.
pub(crate) const LN2_HI: f32 = 0.693_145_75;
pub(crate) const LN2_LO: f32 = 1.428_606_8e-6;

/// `e^x` within ~2 ulp, branch-free so it vectorizes (libm's `expf` is a call per element).
/// Range reduction `x = n ln2 + r` with `|r| <= ln2 / 2`, then a degree-6 Taylor polynomial,
/// whose truncation error there is ~1.2e-7 relative. Inputs below -87.3 give ~2^-126, not 0.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer in float arithmetic.
    const ROUNDER: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.3);
    let shifted = x * LOG2E + ROUNDER;
    let n = shifted - ROUNDER;
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0 + r * (0.5 + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `n` as an integer is the difference of the two floats' bit patterns (same exponent, |n| <
    // 2^22). `n as i32` would be a saturating conversion, which LLVM emits per lane with compares
    // and inserts: it cost SiLU-and-mul ~60% of its time.
    let n_int = shifted.to_bits().wrapping_sub(ROUNDER.to_bits());
    p * f32::from_bits(n_int.wrapping_add(127) << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_within_a_few_ulp() {
        let mut worst = 0.0f32;
        let mut x = -80.0f32;
        while x < 80.0 {
            let (got, want) = (exp(x), (x as f64).exp() as f32);
            worst = worst.max(((got - want) / want).abs());
            x += 0.013;
        }
        assert!(worst < 4e-7, "worst relative error {worst}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1000.0) < 1e-37 && exp(1000.0).is_finite());
    }

    #[test]
    fn sum_squares_covers_tails() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5).collect();
        let want_sq: f32 = a.iter().map(|x| x * x).sum();
        assert!((sum_squares(&a) - want_sq).abs() < 1e-2);
    }
}
