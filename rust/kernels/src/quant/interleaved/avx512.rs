//! The group product on AVX512-VNNI: per block, `vpdpbusd` of each 64-byte chunk (16 rows × 4
//! values) against four activation bytes broadcast to every lane, then one vector of the 16
//! rows' scales. Helpers are functions with the kernel's target features, not closures (a
//! closure would not inherit them, and each intrinsic in it would become a call).

use std::arch::x86_64::*;

use super::{block_sum, Format, GROUP};
use crate::quant::act::{Row, BLOCK};
use crate::simd::{prefetch_stream, STREAM_AHEAD};

/// A re-laid format's integer sums of one group block.
pub(crate) trait Sums {
    const FORMAT: Format;
    /// Row lanes' `Σ u·xq` of group block `b` (values at `values`) for each of the `M` rows.
    ///
    /// # Safety
    /// `values` addresses the block's values; the rows hold block `b`; the CPU has AVX512-VNNI.
    unsafe fn sums<const M: usize>(values: *const u8, b: usize, xs: &[Row<'_>; M]) -> [__m512i; M];
}

pub(crate) struct Q4_0;
pub(crate) struct Q4_1;
pub(crate) struct Q8_0;

impl Sums for Q4_0 {
    const FORMAT: Format = Format::Q4_0;
    #[inline(always)]
    unsafe fn sums<const M: usize>(values: *const u8, b: usize, xs: &[Row<'_>; M]) -> [__m512i; M] {
        nibble_sums(values, b, xs)
    }
}

impl Sums for Q4_1 {
    const FORMAT: Format = Format::Q4_1;
    #[inline(always)]
    unsafe fn sums<const M: usize>(values: *const u8, b: usize, xs: &[Row<'_>; M]) -> [__m512i; M] {
        nibble_sums(values, b, xs)
    }
}

impl Sums for Q8_0 {
    const FORMAT: Format = Format::Q8_0;
    #[inline(always)]
    unsafe fn sums<const M: usize>(values: *const u8, b: usize, xs: &[Row<'_>; M]) -> [__m512i; M] {
        // Two chains (even and odd chunks), so consecutive `vpdpbusd` do not wait on each other.
        let mut even = [_mm512_setzero_si512(); M];
        let mut odd = [_mm512_setzero_si512(); M];
        for c in (0..8).step_by(2) {
            let w0 = _mm512_loadu_si512(values.add(64 * c).cast());
            let w1 = _mm512_loadu_si512(values.add(64 * (c + 1)).cast());
            for r in 0..M {
                even[r] = _mm512_dpbusd_epi32(even[r], w0, quad(&xs[r], b, 4 * c));
                odd[r] = _mm512_dpbusd_epi32(odd[r], w1, quad(&xs[r], b, 4 * c + 4));
            }
        }
        add(even, odd)
    }
}

/// The 4-bit formats: each chunk's low nibbles are elements `8c..8c + 4`, high ones the next 4.
#[inline(always)]
unsafe fn nibble_sums<const M: usize>(values: *const u8, b: usize, xs: &[Row<'_>; M]) -> [__m512i; M] {
    let mask = _mm512_set1_epi8(0x0f);
    let mut low = [_mm512_setzero_si512(); M];
    let mut high = [_mm512_setzero_si512(); M];
    for c in 0..4 {
        let w = _mm512_loadu_si512(values.add(64 * c).cast());
        let lo = _mm512_and_si512(w, mask);
        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), mask);
        for r in 0..M {
            low[r] = _mm512_dpbusd_epi32(low[r], lo, quad(&xs[r], b, 8 * c));
            high[r] = _mm512_dpbusd_epi32(high[r], hi, quad(&xs[r], b, 8 * c + 4));
        }
    }
    add(low, high)
}

/// Activation bytes `e..e + 4` of block `b`, broadcast to every lane.
#[inline(always)]
unsafe fn quad(x: &Row<'_>, b: usize, e: usize) -> __m512i {
    _mm512_set1_epi32(x.q.as_ptr().add(b * BLOCK + e).cast::<i32>().read_unaligned())
}

#[inline(always)]
unsafe fn add<const M: usize>(a: [__m512i; M], b: [__m512i; M]) -> [__m512i; M] {
    let mut out = a;
    for r in 0..M {
        out[r] = _mm512_add_epi32(a[r], b[r]);
    }
    out
}

/// The 16 f16 at `at` as f32 lanes.
#[inline(always)]
unsafe fn halves(at: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()))
}

/// See [`super::GroupDot`].
///
/// # Safety
/// As [`super::GroupDot`]; the CPU has AVX512F, AVX512BW and AVX512-VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(crate) unsafe fn group_dot<S: Sums, const M: usize>(
    group: *const u8,
    blocks: usize,
    xs: &[Row<'_>; M],
) -> [[f32; GROUP]; M] {
    let format = S::FORMAT;
    let mut acc = [_mm512_setzero_ps(); M];
    for b in 0..blocks {
        let gb = group.add(b * format.group_block_bytes());
        prefetch_stream(gb.wrapping_add(STREAM_AHEAD), format.group_block_bytes());
        let d = halves(gb);
        let sums = S::sums(gb.add(format.scale_bytes()), b, xs);
        for r in 0..M {
            let x = &xs[r];
            let mut sum = sums[r];
            if format.offset() != 0 {
                sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(format.offset() * block_sum(x, b)));
            }
            let scale = _mm512_mul_ps(d, _mm512_set1_ps(*x.d.get_unchecked(b)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[r]);
            if format == Format::Q4_1 {
                let m = halves(gb.add(2 * GROUP));
                acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(*x.sum.get_unchecked(b)), acc[r]);
            }
        }
    }
    let mut out = [[0.0f32; GROUP]; M];
    for r in 0..M {
        _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]);
    }
    out
}
