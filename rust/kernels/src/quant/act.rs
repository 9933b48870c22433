//! Activations quantized to 8-bit blocks, so a GGUF weight block meets them in an integer dot
//! product.
//!
//! Every row of `x` is cut into 32-element blocks; block `b` keeps `q = round(x / d)` as `i8`
//! with `d = max|x| / 127` (so `|q| <= 127`, and negating `q` never overflows, which the signed
//! products rely on), `d` itself, `d * Σq` (what a weight block's minimum multiplies), and the
//! eight sums of four consecutive `q` (what an offset such as Q4_0's `- 8` multiplies, one per
//! lane of the integer dot product). One block size serves every weight format: a K-quant's
//! 32-element sub-blocks each meet their own activation scale, which is finer than one scale per
//! 256 elements and costs one float multiply-add per 32 elements.
//!
//! Error: `|x - d q| <= d / 2 = max|x| / 254` per element, so a dot product with weights `w`
//! moves by at most `Σ_b max_b|x| / 254 · Σ_{i in b} |w_i|` (plus float rounding).
//!
//! Costs: one pass over `x` (O(rows · in_features)), against the weight's `out_features` times
//! as many multiply-adds; the rows are quantized once per call.

use crate::element::Element;
use crate::simd::multiversion;

/// Elements per activation block (and per weight sub-block).
pub const BLOCK: usize = 32;

/// The rows of `x`, quantized. `in_features` is a multiple of [`BLOCK`].
pub(crate) struct QuantizedRows {
    in_features: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
    sum4: Vec<[i32; 8]>,
}

/// One quantized row: `q.len() == BLOCK * d.len()`, and `sum`, `sum4` have one entry per block.
#[derive(Clone, Copy)]
pub(crate) struct Row<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub sum: &'a [f32],
    pub sum4: &'a [[i32; 8]],
}

impl QuantizedRows {
    /// Quantizes `x`, `rows` rows of `in_features` (a multiple of [`BLOCK`]; the caller checked
    /// both lengths).
    pub(crate) fn new<T: Element>(x: &[T], in_features: usize) -> Self {
        let blocks = x.len() / BLOCK;
        let mut rows = QuantizedRows {
            in_features,
            q: vec![0; blocks * BLOCK],
            d: vec![0.0; blocks],
            sum: vec![0.0; blocks],
            sum4: vec![[0; 8]; blocks],
        };
        quantize_blocks(x, &mut rows.q, &mut rows.d, &mut rows.sum, &mut rows.sum4);
        rows
    }

    /// Row `r`.
    pub(crate) fn row(&self, r: usize) -> Row<'_> {
        let per_row = self.in_features / BLOCK;
        let blocks = r * per_row..(r + 1) * per_row;
        Row {
            q: &self.q[blocks.start * BLOCK..blocks.end * BLOCK],
            d: &self.d[blocks.clone()],
            sum: &self.sum[blocks.clone()],
            sum4: &self.sum4[blocks],
        }
    }
}

multiversion!(fn quantize_blocks<T>(x: &[T], q: &mut [i8], d: &mut [f32], sum: &mut [f32], sum4: &mut [[i32; 8]]) => quantize_body);

#[inline(always)]
fn quantize_body<T: Element>(x: &[T], q: &mut [i8], d: &mut [f32], sum: &mut [f32], sum4: &mut [[i32; 8]]) {
    let blocks = x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK));
    for (((x, q), d), (sum, sum4)) in blocks.zip(d).zip(sum.iter_mut().zip(sum4)) {
        let mut v = [0.0f32; BLOCK];
        for (v, x) in v.iter_mut().zip(x) {
            *v = x.to_f32();
        }
        let amax = v.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (q, v) in q.iter_mut().zip(v) {
            *q = round_to_int(v * inverse) as i8;
        }
        for (s, four) in sum4.iter_mut().zip(q.chunks_exact(4)) {
            *s = four.iter().map(|&q| i32::from(q)).sum();
        }
        *sum = *d * sum4.iter().sum::<i32>() as f32;
    }
}

/// `v` rounded to the nearest integer (ties to even), for `|v| < 2^22`. Adding 1.5 · 2^23 leaves
/// the integer in the low mantissa bits; unlike `round()` or `as i32` this vectorizes everywhere.
#[inline(always)]
fn round_to_int(v: f32) -> i32 {
    const ROUNDER: f32 = 12_582_912.0;
    (v + ROUNDER).to_bits().wrapping_sub(ROUNDER.to_bits()) as i32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::values;

    #[test]
    fn blocks_reconstruct_within_half_a_step() {
        let x: Vec<f32> = values(2 * 96, 3).iter().enumerate().map(|(i, v)| v * (1 + i % 7) as f32).collect();
        let rows = QuantizedRows::new(&x, 96);
        for r in 0..2 {
            let row = rows.row(r);
            for (i, v) in x[r * 96..(r + 1) * 96].iter().enumerate() {
                let d = row.d[i / BLOCK];
                assert!((v - d * f32::from(row.q[i])).abs() <= 0.5001 * d, "row {r} element {i}");
            }
        }
    }

    #[test]
    fn the_largest_element_maps_to_127_and_sums_follow_q() {
        let mut x = vec![0.25f32; BLOCK];
        x[5] = -2.0;
        let rows = QuantizedRows::new(&x, BLOCK);
        let row = rows.row(0);
        assert_eq!((row.q[5], row.q[0]), (-127, 16));
        assert_eq!(row.sum4[0], [4 * 16, 3 * 16 - 127, 64, 64, 64, 64, 64, 64]);
        let total: i32 = row.q.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(row.sum[0], row.d[0] * total as f32);
    }

    #[test]
    fn a_zero_block_quantizes_to_zeros() {
        let rows = QuantizedRows::new(&[0.0f32; BLOCK], BLOCK);
        let row = rows.row(0);
        assert!(row.q.iter().all(|&q| q == 0));
        assert_eq!((row.d[0], row.sum[0]), (0.0, 0.0));
    }

    #[test]
    fn rounds_ties_to_even() {
        assert_eq!([0.5, 1.5, -2.5, 126.6, -127.0].map(round_to_int), [0, 2, -2, 127, -127]);
    }
}
