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
use crate::quant::blocks::f16_to_f32;
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
    /// Whether the eight sub-blocks' minima come as one vector ([`Simd::mins8`]), met by the
    /// activation's eight block sums at once.
    const MINS8: bool = false;
    /// The eight minima.
    /// # Safety
    /// The CPU has AVX2 and FMA.
    unsafe fn mins8(_prep: &Self::Prep) -> __m256 {
        _mm256_setzero_ps()
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
///
/// Sub-blocks go in pairs, the first into accumulator 0 and the second into 1 (two blocks of a
/// legacy format, two sub-blocks of a K-quant), so consecutive multiply-adds of a row do not
/// wait on each other: with one accumulator the adds' latency, not the loads, set the pace.
#[inline(always)]
unsafe fn body<F: Simd, D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    let blocks = row.len() / F::BYTES;
    for x in xs {
        debug_assert!(x.d.len() >= blocks * F::SUBS && x.q.len() >= blocks * F::SUBS * BLOCK);
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut mins = [[0.0f32; 2]; M];
    let block = |b: usize| row.as_ptr().add(b * F::BYTES);
    if F::SUBS == 1 {
        let mut b = 0;
        while b + 2 <= blocks {
            let (first, second) = (F::prepare(block(b)), F::prepare(block(b + 1)));
            sub_block::<F, D, M, 0>(block(b), &first, 0, b, xs, &mut acc, &mut mins);
            sub_block::<F, D, M, 1>(block(b + 1), &second, 0, b + 1, xs, &mut acc, &mut mins);
            b += 2;
        }
        if b < blocks {
            sub_block::<F, D, M, 0>(block(b), &F::prepare(block(b)), 0, b, xs, &mut acc, &mut mins);
        }
    } else {
        let mut min_acc = [_mm256_setzero_ps(); M];
        for b in 0..blocks {
            let prep = F::prepare(block(b));
            for j in (0..F::SUBS).step_by(2) {
                let s = b * F::SUBS + j;
                sub_block::<F, D, M, 0>(block(b), &prep, j, s, xs, &mut acc, &mut mins);
                sub_block::<F, D, M, 1>(block(b), &prep, j + 1, s + 1, xs, &mut acc, &mut mins);
            }
            if F::MINS8 {
                for (min_acc, x) in min_acc.iter_mut().zip(xs) {
                    let sums = _mm256_loadu_ps(x.sum.as_ptr().add(b * F::SUBS));
                    *min_acc = _mm256_fmadd_ps(F::mins8(&prep), sums, *min_acc);
                }
            }
        }
        for (acc, min_acc) in acc.iter_mut().zip(min_acc) {
            acc[0] = _mm256_add_ps(acc[0], min_acc);
        }
    }
    std::array::from_fn(|r| sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (mins[r][0] + mins[r][1]))
}

/// Sub-block `j` of the block at `block` against activation block `s` of each row, into
/// accumulator `SLOT`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sub_block<F: Simd, D: IntDot, const M: usize, const SLOT: usize>(
    block: *const u8,
    prep: &F::Prep,
    j: usize,
    s: usize,
    xs: &[Row<'_>; M],
    acc: &mut [[__m256; 2]; M],
    mins: &mut [[f32; 2]; M],
) {
    let w = F::sub(block, prep, j);
    let u = if F::SIGNED { _mm256_sign_epi8(w, w) } else { w };
    let scale = F::scale(prep, j);
    for (r, x) in xs.iter().enumerate() {
        let mut xq = _mm256_loadu_si256(x.q.as_ptr().add(s * BLOCK).cast());
        if F::SIGNED {
            xq = _mm256_sign_epi8(xq, w);
        }
        let mut p = D::dot(u, xq);
        if F::OFFSET_SHIFT > 0 {
            let sums = _mm256_loadu_si256(x.sum4.as_ptr().add(s).cast());
            p = _mm256_sub_epi32(p, _mm256_sll_epi32(sums, _mm_cvtsi32_si128(F::OFFSET_SHIFT)));
        }
        let scale = _mm256_mul_ps(scale, _mm256_set1_ps(*x.d.get_unchecked(s)));
        acc[r][SLOT] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), scale, acc[r][SLOT]);
        if F::HAS_MIN {
            mins[r][SLOT] += F::min(prep, j) * *x.sum.get_unchecked(s);
        }
    }
}

/// The f16 at `at`, which is followed by two more bytes of its block. Loading four bytes makes
/// a `vmovd`, which writes the whole register: a two-byte load became `vpinsrw` into whichever
/// register LLVM picked (the accumulator, once), chaining every block's scale to the last sum.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn half(at: *const u8) -> f32 {
    let bits = at.cast::<i32>().read_unaligned();
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

/// A legacy format's `Simd` impl: scale `d` at byte 0, minimum `$min` (of `d` and the block),
/// values from `$sub`.
macro_rules! legacy {
    ($name:ty, signed: $signed:literal, |$block:ident, $d:ident| min: $min:expr, sub: $sub:expr) => {
        impl Simd for $name {
            const SIGNED: bool = $signed;
            const HAS_MIN: bool = !$signed;
            type Prep = (__m256, f32);
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn prepare($block: *const u8) -> Self::Prep {
                let $d = half($block);
                (_mm256_set1_ps($d), $min)
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

// Q4_0's `d (q - 8)` is `d q` with the minimum `-8 d`: one scalar multiply-add per block and
// row, where subtracting `8 Σ xq` per lane took three vector operations.
legacy!(super::Q4_0, signed: false, |b, d| min: -8.0 * d, sub: nibbles(b.add(2)));
legacy!(super::Q4_1, signed: false, |b, d| min: half(b.add(2)), sub: nibbles(b.add(4)));
legacy!(super::Q5_0, signed: false, |b, d| min: -16.0 * d,
    sub: _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2))));
legacy!(super::Q5_1, signed: false, |b, d| min: half(b.add(2)),
    sub: _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))));
legacy!(super::Q8_0, signed: true, |b, d| min: 0.0, sub: _mm256_loadu_si256(b.add(2).cast()));

/// Sub-block `j`'s nibbles of a Q4_K/Q5_K `qs`: low (even `j`) or high (odd `j`) nibbles of
/// `qs[32 * (j / 2)..][..32]`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k_nibbles(qs: *const u8, j: usize) -> __m256i {
    let bytes = _mm256_loadu_si256(qs.add(BLOCK * (j / 2)).cast());
    let shifted = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * (j % 2) as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
}

/// What a Q4_K/Q5_K super-block's sub-blocks share: `d · scale_j` and `-(dmin · min_j)`.
#[derive(Clone, Copy)]
pub(crate) struct KScales {
    scale: [f32; 8],
    min: __m256,
}

/// The eight 6-bit `(scale, min)` pairs of a Q4_K/Q5_K block (layout in `blocks::k_scales`),
/// unpacked eight bytes at a time and converted with one instruction each: the scalar unpack
/// cost more than a sub-block's products.
#[inline(always)]
unsafe fn k_prepare(block: *const u8) -> KScales {
    let word = |at: usize| block.add(4 + at).cast::<u32>().read_unaligned();
    let (low, high, rest) = (word(0), word(4), word(8));
    let six = 0x3f3f_3f3f;
    let top = |w: u32| (w >> 2) & 0x3030_3030;
    let scales = u64::from(low & six) | (u64::from((rest & 0x0f0f_0f0f) | top(low)) << 32);
    let mins = u64::from(high & six) | (u64::from(((rest >> 4) & 0x0f0f_0f0f) | top(high)) << 32);
    let floats = |bytes: u64| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes as i64)));
    let (d, dmin) = (half(block), half(block.add(2)));
    let mut scale = [0.0; 8];
    _mm256_storeu_ps(scale.as_mut_ptr(), _mm256_mul_ps(floats(scales), _mm256_set1_ps(d)));
    KScales { scale, min: _mm256_mul_ps(floats(mins), _mm256_set1_ps(-dmin)) }
}

impl Simd for super::Q4K {
    const MINS8: bool = true;
    type Prep = KScales;
    #[inline(always)]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        k_prepare(block)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, _prep: &Self::Prep, j: usize) -> __m256i {
        k_nibbles(block.add(16), j)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256 {
        _mm256_set1_ps(prep.scale[j])
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mins8(prep: &Self::Prep) -> __m256 {
        prep.min
    }
}

impl Simd for super::Q5K {
    const MINS8: bool = true;
    type Prep = (KScales, __m256i);
    #[inline(always)]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        (k_prepare(block), _mm256_loadu_si256(block.add(16).cast()))
    }
    /// The nibbles as Q4_K's, with bit `j` of `qh[l]` as element `l`'s fifth bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sub(block: *const u8, prep: &Self::Prep, j: usize) -> __m256i {
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(prep.1, bit), bit);
        _mm256_or_si256(k_nibbles(block.add(48), j), _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(prep: &Self::Prep, j: usize) -> __m256 {
        _mm256_set1_ps(prep.0.scale[j])
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mins8(prep: &Self::Prep) -> __m256 {
        prep.0.min
    }
}

impl Simd for super::Q6K {
    const OFFSET_SHIFT: i32 = 5;
    /// `d · scales[g]` for the sixteen 16-element groups.
    type Prep = [f32; 16];
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        // `d` ends the block: `half` would read two bytes past it (past the tensor, at its end).
        let d = f16_to_f32(block.add(208).cast::<u16>().read_unaligned());
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
