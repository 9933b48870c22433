//! The integer products on x86: each format unpacks a 32-element sub-block into the 32 bytes of
//! one AVX2 register, and an [`IntDot`] sums its byte products in groups of four into eight
//! `i32` lanes, `vpmaddubsw` + `vpmaddwd` on AVX2, one `vpdpbusd` on AVX-VNNI or AVX512-VNNI.
//! Both multiply unsigned weight bytes by signed activation bytes, so:
//!
//! - formats with unsigned values (Q4_1, Q5_1, Q4_K, Q5_K) multiply them as they are;
//! - formats stored with an offset (Q4_0's `q - 8`, Q5_0's `- 16`, Q6_K's `- 32`) multiply the
//!   unsigned value and subtract `offset · Σ xq` per lane from the activation's sums of four;
//! - Q8_0's signed bytes go in as `|w|` against `xq` with `w`'s sign (`vpsignb`); `|w| <= 128` and
//!   `|xq| <= 127` keep `vpmaddubsw`'s pair sums below its 16-bit saturation.
//!
//! Lane `n` of the sum covers bytes `4n..4n + 4`, so Q6_K's two 16-element scales apply to lanes
//! 0-3 and 4-7 after the convert to float.

use std::arch::x86_64::*;

use super::{Format, Row, BLOCK};
use crate::quant::subblocks::k_scales;
use crate::simd::sum8;

/// Sums of four byte products, `u` unsigned and `x` signed, in eight `i32` lanes.
pub(crate) trait IntDot {
    /// # Safety
    /// The CPU must have the instructions the implementation names.
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i;
}

struct Maddubs;
impl IntDot for Maddubs {
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))
    }
}

struct AvxVnni;
impl IntDot for AvxVnni {
    #[inline]
    #[target_feature(enable = "avx2,avxvnni")]
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x)
    }
}

struct Avx512Vnni;
impl IntDot for Avx512Vnni {
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    unsafe fn dot(u: __m256i, x: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x)
    }
}

/// A format's blocks unpacked in registers.
pub(crate) trait Simd: Format {
    /// Values are signed bytes (Q8_0), not unsigned ones.
    const SIGNED: bool = false;
    /// `log2` of the offset subtracted from the unsigned values, 0 for none.
    const OFFSET_SHIFT: i32 = 0;
    /// Whether sub-blocks have a minimum.
    const HAS_MIN: bool = false;
    /// What a block's sub-blocks share (decoded scales, loaded high bits).
    type Prep;
    /// # Safety
    /// `block` addresses one whole block; the CPU has AVX2, FMA and F16C.
    unsafe fn prepare(block: *const u8) -> Self::Prep;
    /// Sub-block `j`'s 32 values.
    /// # Safety
    /// As [`Simd::prepare`], with `j < SUBS`.
    unsafe fn sub(block: *const u8, prep: &Self::Prep, j: usize) -> __m256i;
    /// Sub-block `j`'s scale per lane of the integer sums.
    /// # Safety
    /// As [`Simd::sub`].
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256;
    /// Sub-block `j`'s minimum.
    fn min(_prep: &Self::Prep, _j: usize) -> f32 {
        0.0
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn avx2<F: Simd, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    body::<F, Maddubs, M>(row, xs)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn avx_vnni<F: Simd, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    body::<F, AvxVnni, M>(row, xs)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn avx512_vnni<F: Simd, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    body::<F, Avx512Vnni, M>(row, xs)
}

/// See the module doc. Inlined into each instruction set's entry above.
#[inline(always)]
unsafe fn body<F: Simd, D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    let blocks = row.len() / F::BYTES;
    for x in xs {
        debug_assert!(x.d.len() >= blocks * F::SUBS && x.q.len() >= blocks * F::SUBS * BLOCK);
    }
    let shift = _mm_cvtsi32_si128(F::OFFSET_SHIFT);
    let mut acc = [_mm256_setzero_ps(); M];
    let mut mins = [0.0f32; M];
    for b in 0..blocks {
        let block = row.as_ptr().add(b * F::BYTES);
        let prep = F::prepare(block);
        for j in 0..F::SUBS {
            let w = F::sub(block, &prep, j);
            let u = if F::SIGNED { _mm256_sign_epi8(w, w) } else { w };
            let scale = F::scale(&prep, j);
            let s = b * F::SUBS + j;
            for (r, x) in xs.iter().enumerate() {
                let mut xq = _mm256_loadu_si256(x.q.as_ptr().add(s * BLOCK).cast());
                if F::SIGNED {
                    xq = _mm256_sign_epi8(xq, w);
                }
                let mut p = D::dot(u, xq);
                if F::OFFSET_SHIFT > 0 {
                    let sums = _mm256_loadu_si256(x.sum4.as_ptr().add(s).cast());
                    p = _mm256_sub_epi32(p, _mm256_sll_epi32(sums, shift));
                }
                let scale = _mm256_mul_ps(scale, _mm256_set1_ps(*x.d.get_unchecked(s)));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r]);
                if F::HAS_MIN {
                    mins[r] += F::min(&prep, j) * *x.sum.get_unchecked(s);
                }
            }
        }
    }
    std::array::from_fn(|r| sum8(acc[r]) + mins[r])
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn half(at: *const u8) -> f32 {
    let bits = i32::from(at.cast::<u16>().read_unaligned());
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
}

/// The 32 nibbles of `qs[..16]`: low nibbles in bytes 0-15, high ones in 16-31.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles(qs: *const u8) -> __m256i {
    let bytes = _mm_loadu_si128(qs.cast());
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(bytes), bytes);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

/// 16 in byte `i` where bit `i` of the little-endian `qh` is set, else 0.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits(qh: *const u8) -> __m256i {
    let bits = _mm256_set1_epi32(qh.cast::<i32>().read_unaligned());
    // Byte i takes qh's byte i / 8 (the shuffle works within each 128-bit half), then bit i % 8.
    #[rustfmt::skip]
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bytes = _mm256_shuffle_epi8(bits, spread);
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, mask), mask);
    _mm256_and_si256(set, _mm256_set1_epi8(16))
}

/// A legacy format's `Simd` impl: `d` at 0, optionally `m` at 2, values from `$sub`.
macro_rules! legacy {
    ($name:ty, offset_shift: $shift:literal, min: $min:literal, signed: $signed:literal,
     |$block:ident| $sub:expr) => {
        impl Simd for $name {
            const SIGNED: bool = $signed;
            const OFFSET_SHIFT: i32 = $shift;
            const HAS_MIN: bool = $min;
            type Prep = (__m256, f32);
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn prepare(block: *const u8) -> Self::Prep {
                let min = if $min { half(block.add(2)) } else { 0.0 };
                (_mm256_set1_ps(half(block)), min)
            }
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn sub($block: *const u8, _prep: &Self::Prep, _j: usize) -> __m256i {
                $sub
            }
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn scale(prep: &Self::Prep, _j: usize) -> __m256 {
                prep.0
            }
            #[inline(always)]
            fn min(prep: &Self::Prep, _j: usize) -> f32 {
                prep.1
            }
        }
    };
}

legacy!(super::Q4_0, offset_shift: 3, min: false, signed: false, |b| nibbles(b.add(2)));
legacy!(super::Q4_1, offset_shift: 0, min: true, signed: false, |b| nibbles(b.add(4)));
legacy!(super::Q5_0, offset_shift: 4, min: false, signed: false,
    |b| _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2))));
legacy!(super::Q5_1, offset_shift: 0, min: true, signed: false,
    |b| _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))));
legacy!(super::Q8_0, offset_shift: 0, min: false, signed: true, |b| _mm256_loadu_si256(b.add(2).cast()));

/// Sub-block `j`'s nibbles of a Q4_K/Q5_K `qs`: low (even `j`) or high (odd `j`) nibbles of
/// `qs[32 * (j / 2)..][..32]`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k_nibbles(qs: *const u8, j: usize) -> __m256i {
    let bytes = _mm256_loadu_si256(qs.add(BLOCK * (j / 2)).cast());
    let shifted = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * (j % 2) as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
}

impl Simd for super::Q4K {
    const HAS_MIN: bool = true;
    type Prep = ([f32; 8], [f32; 8]);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        k_scales(std::slice::from_raw_parts(block, 16))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, _prep: &Self::Prep, j: usize) -> __m256i {
        k_nibbles(block.add(16), j)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256 {
        _mm256_set1_ps(prep.0[j])
    }
    #[inline(always)]
    fn min(prep: &Self::Prep, j: usize) -> f32 {
        prep.1[j]
    }
}

impl Simd for super::Q5K {
    const HAS_MIN: bool = true;
    type Prep = ([f32; 8], [f32; 8], __m256i);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        let (scale, min) = k_scales(std::slice::from_raw_parts(block, 16));
        (scale, min, _mm256_loadu_si256(block.add(16).cast()))
    }
    /// The nibbles as Q4_K's, with bit `j` of `qh[l]` as element `l`'s fifth bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, prep: &Self::Prep, j: usize) -> __m256i {
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(prep.2, bit), bit);
        _mm256_or_si256(k_nibbles(block.add(48), j), _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256 {
        _mm256_set1_ps(prep.0[j])
    }
    #[inline(always)]
    fn min(prep: &Self::Prep, j: usize) -> f32 {
        prep.1[j]
    }
}

impl Simd for super::Q6K {
    const OFFSET_SHIFT: i32 = 5;
    /// `d · scales[g]` for the sixteen 16-element groups.
    type Prep = [f32; 16];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        let d = half(block.add(208));
        std::array::from_fn(|g| d * f32::from(block.add(192 + g).cast::<i8>().read()))
    }
    /// Half `h = j / 4`, group `k = j % 4`: nibble `k / 2` of `ql[64h + 32 (k % 2)..][..32]`
    /// and bits `2k, 2k + 1` of `qh[32h..][..32]` on top.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, _prep: &Self::Prep, j: usize) -> __m256i {
        let (h, k) = (j / 4, j % 4);
        let low = _mm256_loadu_si256(block.add(64 * h + BLOCK * (k % 2)).cast());
        let low = _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (k / 2) as i32));
        let high = _mm256_loadu_si256(block.add(128 + BLOCK * h).cast());
        let high =
            _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3));
        _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi8(0x0f)), _mm256_slli_epi16::<4>(high))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256 {
        _mm256_set_m128(_mm_set1_ps(prep[2 * j + 1]), _mm_set1_ps(prep[2 * j]))
    }
}
