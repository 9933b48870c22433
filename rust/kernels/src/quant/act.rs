//! Activations quantized to 8-bit blocks, so a GGUF weight block meets them in an integer dot
//! product.
//!
//! Every row of `x` is cut into 32-element blocks; block `b` keeps `q = round(x / d)` as `i8`,
//! `d` itself and `d * Σq` (what a weight block's minimum multiplies), and each 16 elements keep
//! `Σq` as `i16` (what Q6_K's offset of 32 multiplies, with its 16-element scales).
//! `d = max|x| / 127` over a *group* of blocks (so `|q| <= 127`, and negating `q` never
//! overflows, which the signed products rely on): the weight's block length, 32 for the legacy formats, whose every block brings its own
//! float scale anyway, and 256 for the K-quants, so a super-block's eight sub-blocks share one
//! activation scale and their integer sums add up before one conversion to float (`d` is
//! stored per 32-block all the same, repeated within a group).
//!
//! Error: `|x - d q| <= d / 2 = max|x| / 254` per element, so a dot product with weights `w`
//! moves by at most `Σ_g max_g|x| / 254 · Σ_{i in g} |w_i|` over the groups (plus float rounding).
//!
//! Costs: one pass over `x` (O(rows · in_features)), against the weight's `out_features` times
//! as many multiply-adds; the rows are quantized once per call.

use crate::element::Element;
use crate::simd::multiversion;

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Elements per activation block (and per weight sub-block).
pub const BLOCK: usize = 32;

/// The rows of `x`, quantized. `in_features` is a multiple of [`BLOCK`].
pub(crate) struct QuantizedRows {
    in_features: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<f32>,
    sum16: Vec<i16>,
}

/// One quantized row: `q.len() == BLOCK * d.len()`, `sum` has one entry per block and `sum16`
/// two.
#[derive(Clone, Copy)]
pub(crate) struct Row<'a> {
    pub q: &'a [i8],
    pub d: &'a [f32],
    pub sum: &'a [f32],
    pub sum16: &'a [i16],
}

impl QuantizedRows {
    /// Quantizes `x`, rows of `in_features`, with one scale per `group` elements (32 or 256;
    /// `in_features` is a multiple of it, and `x` of `in_features`: the caller checked).
    pub(crate) fn new<T: Element>(x: &[T], in_features: usize, group: usize) -> Self {
        let blocks = x.len() / BLOCK;
        let mut rows = QuantizedRows {
            in_features,
            q: vec![0; blocks * BLOCK],
            d: vec![0.0; blocks],
            sum: vec![0.0; blocks],
            sum16: vec![0; 2 * blocks],
        };
        #[cfg(target_arch = "x86_64")]
        if let (Some(x), true) = (crate::element::as_f32(x), avx512::available()) {
            // SAFETY: the CPU has the kernel's features; the buffers were sized above.
            unsafe { avx512::quantize(x, group, &mut rows.q, &mut rows.d, &mut rows.sum, &mut rows.sum16) };
            return rows;
        }
        rows.quantize_portable(x, group);
        rows
    }

    /// [`QuantizedRows::new`]'s work in plain Rust (the AVX-512 loop computes the same values
    /// with the same operations, so the two agree bit for bit).
    fn quantize_portable<T: Element>(&mut self, x: &[T], group: usize) {
        let per_group = group / BLOCK;
        let groups = x.chunks_exact(group).zip(self.q.chunks_exact_mut(group));
        let scales = self.d.chunks_exact_mut(per_group).zip(self.sum.chunks_exact_mut(per_group));
        for ((x, q), (d, sum)) in groups.zip(scales) {
            quantize_group(x, q, d, sum);
        }
        for (sum, q) in self.sum16.iter_mut().zip(self.q.chunks_exact(16)) {
            // |Σq| <= 16 · 127 fits in i16.
            *sum = q.iter().map(|&q| i16::from(q)).sum();
        }
    }

    /// [`QuantizedRows::new`] of `2 · rows` rows: row `2i` quantizes row `i` of `x`, row `2i + 1`
    /// what that left over (`x - d q`, in f32). A product summing each pair's two results meets
    /// activations within `max|x| / 254²` per element instead of `max|x| / 254`, at twice the
    /// integer work and still one read of the weight.
    pub(crate) fn with_residual<T: Element>(x: &[T], in_features: usize, group: usize) -> Self {
        let first = QuantizedRows::new(x, in_features, group);
        let mut pairs = Vec::with_capacity(2 * x.len());
        for (r, x) in x.chunks_exact(in_features).enumerate() {
            let row = first.row(r);
            pairs.extend(x.iter().map(|v| v.to_f32()));
            let rounded = row.q.iter().enumerate().map(|(i, &q)| row.d[i / BLOCK] * f32::from(q));
            pairs.extend(x.iter().zip(rounded).map(|(v, rounded)| v.to_f32() - rounded));
        }
        QuantizedRows::new(&pairs, in_features, group)
    }

    /// The number of rows.
    pub(crate) fn rows(&self) -> usize {
        self.q.len() / self.in_features.max(1)
    }

    /// Row `r`.
    pub(crate) fn row(&self, r: usize) -> Row<'_> {
        let per_row = self.in_features / BLOCK;
        let blocks = r * per_row..(r + 1) * per_row;
        Row {
            q: &self.q[blocks.start * BLOCK..blocks.end * BLOCK],
            d: &self.d[blocks.clone()],
            sum: &self.sum[blocks.clone()],
            sum16: &self.sum16[2 * blocks.start..2 * blocks.end],
        }
    }
}

multiversion!(fn quantize_group<T>(x: &[T], q: &mut [i8], d: &mut [f32], sum: &mut [f32]) => quantize_body);

/// One group: its scale into every block's `d`, and each block's `d · Σq`.
#[inline(always)]
fn quantize_body<T: Element>(x: &[T], q: &mut [i8], d: &mut [f32], sum: &mut [f32]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.to_f32().abs()));
    let scale = amax / 127.0;
    let inverse = if amax > 0.0 { 127.0 / amax } else { 0.0 };
    for (q, v) in q.iter_mut().zip(x) {
        *q = round_to_int(v.to_f32() * inverse) as i8;
    }
    for ((d, sum), q) in d.iter_mut().zip(sum).zip(q.chunks_exact(BLOCK)) {
        *d = scale;
        *sum = scale * q.iter().map(|&q| i32::from(q)).sum::<i32>() as f32;
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
        let rows = QuantizedRows::new(&x, 96, BLOCK);
        for r in 0..2 {
            let row = rows.row(r);
            for (i, v) in x[r * 96..(r + 1) * 96].iter().enumerate() {
                let d = row.d[i / BLOCK];
                assert!((v - d * f32::from(row.q[i])).abs() <= 0.5001 * d, "row {r} element {i}");
            }
        }
    }

    #[test]
    fn a_residual_pair_reconstructs_within_half_a_step_of_the_residual() {
        let x: Vec<f32> = values(2 * 96, 5).iter().enumerate().map(|(i, v)| v * (1 + i % 5) as f32).collect();
        let rows = QuantizedRows::with_residual(&x, 96, BLOCK);
        assert_eq!(rows.rows(), 4);
        for r in 0..2 {
            let (value, rest) = (rows.row(2 * r), rows.row(2 * r + 1));
            for (i, v) in x[r * 96..(r + 1) * 96].iter().enumerate() {
                let b = i / BLOCK;
                let got = value.d[b] * f32::from(value.q[i]) + rest.d[b] * f32::from(rest.q[i]);
                // The residual's step is at most the value's over 254.
                assert!(rest.d[b] <= value.d[b] / 254.0 * 1.0001, "row {r} block {b}");
                assert!((v - got).abs() <= 0.5001 * rest.d[b] + 1e-6 * v.abs(), "row {r} element {i}");
            }
        }
    }

    #[test]
    fn the_largest_element_maps_to_127_and_the_sum_follows_q() {
        let mut x = vec![0.25f32; BLOCK];
        x[5] = -2.0;
        let rows = QuantizedRows::new(&x, BLOCK, BLOCK);
        let row = rows.row(0);
        assert_eq!((row.q[5], row.q[0]), (-127, 16));
        let total: i32 = row.q.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(row.sum[0], row.d[0] * total as f32);
        assert_eq!(row.sum16, [5 * 16 - 127 + 10 * 16, 16 * 16]);
    }

    #[test]
    fn a_zero_block_quantizes_to_zeros() {
        let rows = QuantizedRows::new(&[0.0f32; BLOCK], BLOCK, BLOCK);
        let row = rows.row(0);
        assert!(row.q.iter().all(|&q| q == 0));
        assert_eq!((row.d[0], row.sum[0]), (0.0, 0.0));
    }

    #[test]
    fn a_group_of_eight_blocks_shares_its_largest_scale() {
        let x: Vec<f32> = (0..512).map(|i| if i == 300 { 5.08 } else { (i % 9) as f32 * 0.1 }).collect();
        let rows = QuantizedRows::new(&x, 512, 256);
        let row = rows.row(0);
        assert!(row.d[..8].iter().all(|&d| d == 0.8 / 127.0), "group 0's largest is x[8] = 0.8");
        assert!(row.d[8..].iter().all(|&d| d == 5.08 / 127.0), "group 1's largest is x[300]");
        assert_eq!((row.q[8], row.q[300], row.q[263]), (127, 127, 5));
        assert_eq!(row.sum[1], row.d[1] * row.q[32..64].iter().map(|&q| i32::from(q)).sum::<i32>() as f32);
    }

    #[test]
    fn the_vector_loop_matches_the_portable_one_bit_for_bit() {
        for (group, in_features) in [(BLOCK, 32), (BLOCK, 96), (BLOCK, 576), (256, 512), (256, 1536)] {
            let mut x: Vec<f32> = values(3 * in_features, 11)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1 + i % 13) as f32)
                .collect();
            x[..BLOCK].fill(0.0); // a zero block: scale 0, no division
            x[40] = 0.5 * x[41].abs().max(1e-3) / 127.0 * 255.0; // near a rounding tie
            let fast = QuantizedRows::new(&x, in_features, group);
            let mut slow = QuantizedRows::new(&x, in_features, group);
            slow.quantize_portable(&x, group);
            assert_eq!((&fast.q, &fast.sum16), (&slow.q, &slow.sum16), "group {group}, {in_features}");
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!((bits(&fast.d), bits(&fast.sum)), (bits(&slow.d), bits(&slow.sum)));
        }
    }

    #[test]
    fn rounds_ties_to_even() {
        assert_eq!([0.5, 1.5, -2.5, 126.6, -127.0].map(round_to_int), [0, 2, -2, 127, -127]);
    }
}
