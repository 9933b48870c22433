//! K-quant products on x86. The activations share one scale per 256 elements ([`crate::quant`]'s
//! `act`, group 256), so within a super-block each sub-block's byte products are multiplied by
//! its integer scale (`vpmaddwd` against the scales where the legacy formats use ones) and added
//! up in `i32`: one convert and one float multiply-add per super-block and row, where a float
//! scale per 32 elements cost three more operations per sub-block and row.
//!
//! `vpdpbusd` has no 16-bit stage to apply a scale at, so the VNNI entries run this
//! `vpmaddubsw` form too. Q6_K multiplies its unsigned `q` and takes `32 · Σ_g scale_g · Σ_g xq`
//! off once per super-block, from the activation's 16-element sums. Bounds: values `<= 63`
//! against `|xq| <= 127` keep pair sums under `vpmaddubsw`'s 16-bit saturation, and scales of
//! 6 bits (Q6_K's: 8) keep eight sub-blocks' sums far inside `i32`.

use std::arch::x86_64::*;

use super::super::{Format, Q4K, Q5K, Q6K};
use super::{halves, IntDot, Kernel, Row, BLOCK};
use crate::quant::blocks::f16_to_f32;
use crate::simd::sum8;

/// Sub-blocks in a super-block.
const SUBS: usize = 8;

/// A K-quant super-block unpacked in registers.
trait KQuant: Format {
    /// Values are stored plus 32 (Q6_K), with [`KQuant::scales16`] for their 16-element groups.
    const OFFSET_32: bool = false;
    /// What the sub-blocks share.
    type Prep;
    /// # Safety
    /// `block` addresses one whole block; the CPU has AVX2, FMA and F16C.
    unsafe fn prepare(block: *const u8) -> Self::Prep;
    /// Sub-block `j`'s 32 values.
    /// # Safety
    /// As [`KQuant::prepare`], `j < 8`.
    unsafe fn values(block: *const u8, prep: &Self::Prep, j: usize) -> __m256i;
    /// Sub-block `j`'s integer scale for each 16-bit lane of `vpmaddubsw`'s pair sums.
    /// # Safety
    /// As [`KQuant::values`].
    unsafe fn int_scales(prep: &Self::Prep, j: usize) -> __m256i;
    /// The super-block's float scale `d`.
    fn d(prep: &Self::Prep) -> f32;
    /// The eight sub-blocks' minima as floats, if the format has them.
    /// # Safety
    /// The CPU has AVX2.
    unsafe fn mins(prep: &Self::Prep) -> Option<__m256>;
    /// The sixteen 16-element groups' scales, for [`KQuant::OFFSET_32`].
    /// # Safety
    /// The CPU has AVX2.
    unsafe fn scales16(_prep: &Self::Prep) -> __m256i {
        _mm256_setzero_si256()
    }
}

#[inline(always)]
unsafe fn k_body<F: KQuant, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    let blocks = row.len() / F::BYTES;
    for x in xs {
        debug_assert!(x.d.len() >= blocks * SUBS && x.sum16.len() >= blocks * 2 * SUBS);
    }
    let mut acc = [_mm256_setzero_ps(); M];
    let mut min_acc = [_mm256_setzero_ps(); M];
    for b in 0..blocks {
        let block = row.as_ptr().add(b * F::BYTES);
        let prep = F::prepare(block);
        let mut sums = [_mm256_setzero_si256(); M];
        for j in 0..SUBS {
            let u = F::values(block, &prep, j);
            let scales = F::int_scales(&prep, j);
            for (sum, x) in sums.iter_mut().zip(xs) {
                let xq = _mm256_loadu_si256(x.q.as_ptr().add((b * SUBS + j) * BLOCK).cast());
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, xq), scales));
            }
        }
        if F::OFFSET_32 {
            let scales16 = F::scales16(&prep);
            for (sum, x) in sums.iter_mut().zip(xs) {
                let groups = _mm256_loadu_si256(x.sum16.as_ptr().add(b * 2 * SUBS).cast());
                *sum = _mm256_sub_epi32(*sum, _mm256_slli_epi32::<5>(_mm256_madd_epi16(scales16, groups)));
            }
        }
        let mins = F::mins(&prep);
        for (r, x) in xs.iter().enumerate() {
            let scale = _mm256_set1_ps(F::d(&prep) * *x.d.get_unchecked(b * SUBS));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r]);
            if let Some(mins) = mins {
                let block_sums = _mm256_loadu_ps(x.sum.as_ptr().add(b * SUBS));
                min_acc[r] = _mm256_fmadd_ps(mins, block_sums, min_acc[r]);
            }
        }
    }
    std::array::from_fn(|r| sum8(_mm256_add_ps(acc[r], min_acc[r])))
}

/// What a Q4_K/Q5_K super-block's sub-blocks share: `d`, the 6-bit scales and `-(dmin · min_j)`.
#[derive(Clone, Copy)]
struct KScales {
    d: f32,
    scales: [u8; 8],
    mins: __m256,
}

/// The eight 6-bit `(scale, min)` pairs of a Q4_K/Q5_K block (layout in `blocks::k_scales`),
/// unpacked eight bytes at a time: the scalar unpack cost more than a sub-block's products.
#[inline(always)]
unsafe fn k_scales(block: *const u8) -> KScales {
    let word = |at: usize| block.add(4 + at).cast::<u32>().read_unaligned();
    let (low, high, rest) = (word(0), word(4), word(8));
    let six = 0x3f3f_3f3f;
    let top = |w: u32| (w >> 2) & 0x3030_3030;
    let scales = u64::from(low & six) | (u64::from((rest & 0x0f0f_0f0f) | top(low)) << 32);
    let mins = u64::from(high & six) | (u64::from(((rest >> 4) & 0x0f0f_0f0f) | top(high)) << 32);
    let floats = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(mins as i64)));
    let (d, dmin) = halves(block);
    KScales { d, scales: scales.to_le_bytes(), mins: _mm256_mul_ps(floats, _mm256_set1_ps(-dmin)) }
}

/// Sub-block `j`'s nibbles of a Q4_K/Q5_K `qs`: low (even `j`) or high (odd `j`) nibbles of
/// `qs[32 * (j / 2)..][..32]`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k_nibbles(qs: *const u8, j: usize) -> __m256i {
    let bytes = _mm256_loadu_si256(qs.add(BLOCK * (j / 2)).cast());
    let shifted = _mm256_srl_epi16(bytes, _mm_cvtsi32_si128(4 * (j % 2) as i32));
    _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f))
}

impl KQuant for Q4K {
    type Prep = KScales;
    #[inline(always)]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        k_scales(block)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(block: *const u8, _prep: &Self::Prep, j: usize) -> __m256i {
        k_nibbles(block.add(16), j)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int_scales(prep: &Self::Prep, j: usize) -> __m256i {
        _mm256_set1_epi16(i16::from(prep.scales[j]))
    }
    #[inline(always)]
    fn d(prep: &Self::Prep) -> f32 {
        prep.d
    }
    #[inline(always)]
    unsafe fn mins(prep: &Self::Prep) -> Option<__m256> {
        Some(prep.mins)
    }
}

impl KQuant for Q5K {
    type Prep = (KScales, __m256i);
    #[inline(always)]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        (k_scales(block), _mm256_loadu_si256(block.add(16).cast()))
    }
    /// The nibbles as Q4_K's, with bit `j` of `qh[l]` as element `l`'s fifth bit.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(block: *const u8, prep: &Self::Prep, j: usize) -> __m256i {
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(prep.1, bit), bit);
        _mm256_or_si256(k_nibbles(block.add(48), j), _mm256_and_si256(set, _mm256_set1_epi8(16)))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int_scales(prep: &Self::Prep, j: usize) -> __m256i {
        _mm256_set1_epi16(i16::from(prep.0.scales[j]))
    }
    #[inline(always)]
    fn d(prep: &Self::Prep) -> f32 {
        prep.0.d
    }
    #[inline(always)]
    unsafe fn mins(prep: &Self::Prep) -> Option<__m256> {
        Some(prep.0.mins)
    }
}

impl KQuant for Q6K {
    const OFFSET_32: bool = true;
    /// `d`, the sixteen `i8` scales of 16-element groups, and them widened to `i16`.
    type Prep = (f32, [i8; 16], __m256i);
    #[inline(always)]
    unsafe fn prepare(block: *const u8) -> Self::Prep {
        // `d` ends the block: `halves` would read six bytes past it (past the tensor, at its end).
        let d = f16_to_f32(block.add(208).cast::<u16>().read_unaligned());
        let scales = block.add(192).cast::<[i8; 16]>().read_unaligned();
        (d, scales, _mm256_cvtepi8_epi16(_mm_loadu_si128(block.add(192).cast())))
    }
    /// Half `h = j / 4`, group `k = j % 4`: nibble `k / 2` of `ql[64h + 32 (k % 2)..][..32]`
    /// and bits `2k, 2k + 1` of `qh[32h..][..32]` on top.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(block: *const u8, _prep: &Self::Prep, j: usize) -> __m256i {
        let (h, k) = (j / 4, j % 4);
        let low = _mm256_loadu_si256(block.add(64 * h + BLOCK * (k % 2)).cast());
        let low = _mm256_and_si256(
            _mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (k / 2) as i32)),
            _mm256_set1_epi8(0x0f),
        );
        let high = _mm256_loadu_si256(block.add(128 + BLOCK * h).cast());
        let high =
            _mm256_and_si256(_mm256_srl_epi16(high, _mm_cvtsi32_si128(2 * k as i32)), _mm256_set1_epi8(3));
        _mm256_or_si256(low, _mm256_slli_epi16::<4>(high))
    }
    /// Pair sums 0-7 come from bytes 0-15 (group `2j`), 8-15 from bytes 16-31 (group `2j + 1`).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn int_scales(prep: &Self::Prep, j: usize) -> __m256i {
        let (first, second) = (i16::from(prep.1[2 * j]), i16::from(prep.1[2 * j + 1]));
        _mm256_set_m128i(_mm_set1_epi16(second), _mm_set1_epi16(first))
    }
    #[inline(always)]
    fn d(prep: &Self::Prep) -> f32 {
        prep.0
    }
    #[inline(always)]
    unsafe fn mins(_prep: &Self::Prep) -> Option<__m256> {
        None
    }
    #[inline(always)]
    unsafe fn scales16(prep: &Self::Prep) -> __m256i {
        prep.2
    }
}

macro_rules! kernel {
    ($($name:ty),*) => {$(
        impl Kernel for $name {
            #[inline(always)]
            unsafe fn run<D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
                k_body::<Self, M>(row, xs)
            }
        }
    )*};
}
kernel!(Q4K, Q5K, Q6K);
