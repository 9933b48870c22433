//! The fp8 kernels' AVX2 loops: e4m3 bytes decoded sixteen at a time through IEEE halves
//! (F16C), a row's dot products with one or two rows of `x`, and a row's decoding for tiles.

use std::arch::x86_64::*;
use std::ops::Range;

use crate::quant::wq::GroupWalk;
use crate::simd::sum8;

/// Decoded halves are the e4m3 values times 2^-8 (the exponent biases differ by 8).
const HALF_BIAS: f32 = 256.0;

/// Whether these loops run here: AVX2, FMA and F16C.
pub(super) fn available() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| crate::simd::has_avx2_fma() && is_x86_feature_detected!("f16c"))
}

/// Sixteen e4m3 bytes at `p` as two vectors of their values times 2^-8: sign to bit 15,
/// exponent and mantissa to bits 7-13 of a half; the NaN encodings get the half's NaN exponent.
#[inline(always)]
unsafe fn load16(p: *const u8) -> [__m256; 2] {
    let w = _mm256_cvtepu8_epi16(_mm_loadu_si128(p.cast()));
    let sign = _mm256_and_si256(_mm256_slli_epi16::<8>(w), _mm256_set1_epi16(i16::MIN));
    let magnitude = _mm256_and_si256(_mm256_slli_epi16::<7>(w), _mm256_set1_epi16(0x3f80));
    let nan =
        _mm256_and_si256(_mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x3f80)), _mm256_set1_epi16(0x7c00));
    let half = _mm256_or_si256(_mm256_or_si256(sign, magnitude), nan);
    [_mm256_cvtph_ps(_mm256_castsi256_si128(half)), _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(half))]
}

/// Weight row `row` dotted with `M` rows of `x` (`stride` apart), scale `scales[g]` on the
/// columns of group `g` (`group` wide, a multiple of 16 unless there is one group).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `x` holds `M` rows of `stride >= row.len()`; `scales` has
/// `ceil(row.len() / group)` entries.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn row_dot<const M: usize>(
    row: &[u8],
    x: &[f32],
    stride: usize,
    scales: &[f32],
    group: usize,
) -> [f32; M] {
    let (k, w, xp) = (row.len(), row.as_ptr(), x.as_ptr());
    // Scaled sums: each group's sum goes into the first, then the two swap.
    let mut total = [[_mm256_setzero_ps(); 2]; M];
    let mut tail = [0.0f32; M];
    for (g, &scale) in scales.iter().enumerate() {
        let (start, end) = (g * group, ((g + 1) * group).min(k));
        let whole = start + (end - start) / 16 * 16;
        let mut acc = [[_mm256_setzero_ps(); 4]; M];
        let mut c = start;
        while c + 32 <= whole {
            let (a, b) = (load16(w.add(c)), load16(w.add(c + 16)));
            for (m, acc) in acc.iter_mut().enumerate() {
                let xr = xp.add(m * stride + c);
                acc[0] = _mm256_fmadd_ps(a[0], _mm256_loadu_ps(xr), acc[0]);
                acc[1] = _mm256_fmadd_ps(a[1], _mm256_loadu_ps(xr.add(8)), acc[1]);
                acc[2] = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(xr.add(16)), acc[2]);
                acc[3] = _mm256_fmadd_ps(b[1], _mm256_loadu_ps(xr.add(24)), acc[3]);
            }
            c += 32;
        }
        if c < whole {
            let a = load16(w.add(c));
            for (m, acc) in acc.iter_mut().enumerate() {
                let xr = xp.add(m * stride + c);
                acc[0] = _mm256_fmadd_ps(a[0], _mm256_loadu_ps(xr), acc[0]);
                acc[1] = _mm256_fmadd_ps(a[1], _mm256_loadu_ps(xr.add(8)), acc[1]);
            }
        }
        let s = _mm256_set1_ps(scale * HALF_BIAS);
        for (m, (t, a)) in total.iter_mut().zip(&acc).enumerate() {
            let sum = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            *t = [t[1], _mm256_fmadd_ps(sum, s, t[0])];
            let rest: f32 = (whole..end).map(|i| super::e4m3_to_f32(row[i]) * x[m * stride + i]).sum();
            tail[m] += scale * rest;
        }
    }
    let mut dots = [0.0; M];
    for ((dot, t), rest) in dots.iter_mut().zip(&total).zip(tail) {
        *dot = sum8(_mm256_add_ps(t[0], t[1])) + rest;
    }
    dots
}

/// Writes `row[c] · scales[c / group]` to `out[c - cols.start]` for the whole 16-byte pieces
/// of `cols`; returns the column it stopped at.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `cols` lies in `row`, `out` holds `cols.len()` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn decode(
    row: &[u8],
    cols: Range<usize>,
    scales: &[f32],
    group: usize,
    out: &mut [f32],
) -> usize {
    let mut c = cols.start;
    // Groups are multiples of 16 wide (or the whole row), so one scale covers each piece.
    let mut groups = GroupWalk::new(group, c);
    while c + 16 <= cols.end {
        let s = _mm256_set1_ps(scales[groups.next()] * HALF_BIAS);
        let v = load16(row.as_ptr().add(c));
        let dst = out.as_mut_ptr().add(c - cols.start);
        _mm256_storeu_ps(dst, _mm256_mul_ps(v[0], s));
        _mm256_storeu_ps(dst.add(8), _mm256_mul_ps(v[1], s));
        c += 16;
    }
    c
}
