//! The integer products on x86: each format unpacks a 32-element sub-block into the 32 bytes of
//! one AVX2 register and multiplies them, as unsigned bytes, with the activation's signed bytes.
//!
//! - Legacy formats (here): an [`IntDot`] sums the products in groups of four into eight `i32`
//!   lanes, `vpmaddubsw` + `vpmaddwd` on AVX2, one `vpdpbusd` on AVX-VNNI or AVX512-VNNI, and
//!   each block's sum turns to float against its own scale. Q4_1 and Q5_1 multiply their
//!   unsigned values as they are; Q4_0's `d (q - 8)` and Q5_0's `d (q - 16)` take `-8 d`, `-16 d`
//!   as their minimum; Q8_0's signed bytes go in as `|w|` against `xq` with `w`'s sign
//!   (`vpsignb`), where `|w| <= 128` and `|xq| <= 127` keep `vpmaddubsw`'s pair sums below its
//!   16-bit saturation.
//! - K-quants ([`kquants`]): their 6- and 8-bit sub-block scales multiply in integers.

mod kquants;

use std::arch::x86_64::*;

use super::{Format, Row, BLOCK};
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

/// A legacy format's 32-element block unpacked in registers.
pub(crate) trait Legacy: Format {
    /// Values are signed bytes (Q8_0, no minimum), not unsigned ones.
    const SIGNED: bool = false;
    /// The block's scale and minimum.
    /// # Safety
    /// `block` addresses one whole block; the CPU has AVX2, FMA and F16C.
    unsafe fn scales(block: *const u8) -> (f32, f32);
    /// The block's 32 values.
    /// # Safety
    /// As [`Legacy::scales`].
    unsafe fn values(block: *const u8) -> __m256i;
}

/// A format's product on x86, generic over the instruction that sums byte products.
pub(crate) trait Kernel {
    /// # Safety
    /// As [`super::RowsDot`]; the CPU has AVX2, FMA, F16C and what `D` names.
    unsafe fn run<D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M];
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn avx2<F: Kernel, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    F::run::<Maddubs, M>(row, xs)
}

#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
pub(crate) unsafe fn avx_vnni<F: Kernel, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    F::run::<AvxVnni, M>(row, xs)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn avx512_vnni<F: Kernel, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    F::run::<Avx512Vnni, M>(row, xs)
}

/// A legacy format's product, inlined into each instruction set's entry above.
///
/// Blocks go in pairs, the first into accumulator 0 and the second into 1, so consecutive
/// multiply-adds of a row do not wait on each other: with one accumulator the adds' latency, not
/// the loads, set the pace.
#[inline(always)]
unsafe fn legacy_body<F: Legacy, D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    let blocks = row.len() / F::BYTES;
    for x in xs {
        debug_assert!(x.d.len() >= blocks && x.q.len() >= blocks * BLOCK);
    }
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut mins = [[0.0f32; 2]; M];
    let block = |b: usize| row.as_ptr().add(b * F::BYTES);
    let mut b = 0;
    while b + 2 <= blocks {
        legacy_block::<F, D, M, 0>(block(b), b, xs, &mut acc, &mut mins);
        legacy_block::<F, D, M, 1>(block(b + 1), b + 1, xs, &mut acc, &mut mins);
        b += 2;
    }
    if b < blocks {
        legacy_block::<F, D, M, 0>(block(b), b, xs, &mut acc, &mut mins);
    }
    std::array::from_fn(|r| sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (mins[r][0] + mins[r][1]))
}

/// Block `b` (at `block`) against activation block `b` of each row, into accumulator `SLOT`.
#[inline(always)]
unsafe fn legacy_block<F: Legacy, D: IntDot, const M: usize, const SLOT: usize>(
    block: *const u8,
    b: usize,
    xs: &[Row<'_>; M],
    acc: &mut [[__m256; 2]; M],
    mins: &mut [[f32; 2]; M],
) {
    let (d, min) = F::scales(block);
    let w = F::values(block);
    let u = if F::SIGNED { _mm256_sign_epi8(w, w) } else { w };
    for (r, x) in xs.iter().enumerate() {
        let mut xq = _mm256_loadu_si256(x.q.as_ptr().add(b * BLOCK).cast());
        if F::SIGNED {
            xq = _mm256_sign_epi8(xq, w);
        }
        let scale = _mm256_set1_ps(d * *x.d.get_unchecked(b));
        acc[r][SLOT] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D::dot(u, xq)), scale, acc[r][SLOT]);
        if !F::SIGNED {
            mins[r][SLOT] += min * *x.sum.get_unchecked(b);
        }
    }
}

/// The f16 values at `at` and `at + 2` (the first two of four: the block holds eight bytes
/// there), converted by `vcvtph2ps xmm, m64`, which writes the whole register. Written with
/// intrinsics, LLVM shrank the load to the two bytes it needed and made it a `vpinsrw` into
/// whichever register it picked (an accumulator, each time it was measured), so every block's
/// scale waited on the previous block's sums: Q4_0 and Q8_0 ran at half speed. `asm!` keeps
/// the eight-byte load.
///
/// # Safety
/// `at` addresses eight readable bytes; the CPU has F16C.
#[inline(always)]
unsafe fn halves(at: *const u8) -> (f32, f32) {
    let both: __m128;
    std::arch::asm!(
        "vcvtph2ps {both}, qword ptr [{at}]",
        at = in(reg) at,
        both = out(xmm_reg) both,
        options(pure, readonly, nostack, preserves_flags),
    );
    (_mm_cvtss_f32(both), _mm_cvtss_f32(_mm_movehdup_ps(both)))
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

/// A legacy format's [`Legacy`] and [`Kernel`] impls: scale `d` at byte 0, minimum `$min` (a
/// closure of the f16 after `d`), values `$values`.
macro_rules! legacy {
    ($name:ty, signed: $signed:literal, |$block:ident, $d:ident| min: $min:expr, values: $values:expr) => {
        impl Legacy for $name {
            const SIGNED: bool = $signed;
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn scales($block: *const u8) -> (f32, f32) {
                let ($d, second) = halves($block);
                ($d, $min(second))
            }
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn values($block: *const u8) -> __m256i {
                $values
            }
        }
        impl Kernel for $name {
            #[inline(always)]
            unsafe fn run<D: IntDot, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
                legacy_body::<Self, D, M>(row, xs)
            }
        }
    };
}

// Q4_0's `d (q - 8)` is `d q` with the minimum `-8 d`: one scalar multiply-add per block and
// row, where subtracting `8 Σ xq` per lane took three vector operations.
// `$min` gets the f16 after `d` (the minimum `m` where the block has one).
legacy!(super::Q4_0, signed: false, |b, d| min: |_| -8.0 * d, values: nibbles(b.add(2)));
legacy!(super::Q4_1, signed: false, |b, d| min: |m| m, values: nibbles(b.add(4)));
legacy!(super::Q5_0, signed: false, |b, d| min: |_| -16.0 * d,
    values: _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2))));
legacy!(super::Q5_1, signed: false, |b, d| min: |m| m,
    values: _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))));
legacy!(super::Q8_0, signed: true, |b, d| min: |_| 0.0, values: _mm256_loadu_si256(b.add(2).cast()));
