//! The weight-only kernels' AVX2 loops: a weight row's dot products with one or two rows of `x`
//! (decode steps), and a row's decoding into f32 for the tiles of bigger batches.
//!
//! Both read a row as 32-element blocks ([`Block::load`]: four vectors of eight lanes holding
//! elements 0-7, 8-15, 16-23, 24-31 as f32). A dot product sums `q · x` per group in vector
//! accumulators, two blocks' worth in flight for one row of `x` so no multiply-add waits on the
//! one before, then scales the group's sum with one multiply-add into an accumulator that
//! alternates between groups for the same reason.

use std::arch::x86_64::*;

use super::{Layout, QWeight, Weights, INT4_BLOCK};
use crate::simd::sum8;

/// A stored block of 32 elements as four vectors of f32.
trait Block {
    /// # Safety
    /// `row` addresses a stored row with at least `block + 1` whole blocks; the CPU has AVX2.
    unsafe fn load(row: *const u8, block: usize) -> [__m256; 4];
}

/// The stored formats, as markers for each instruction set's `Block` loader.
pub(super) struct Int4;
pub(super) struct Int8;

impl Block for Int4 {
    /// 16 bytes: the low nibbles of bytes 0-15 are elements 0-15, the high ones 16-31.
    #[inline(always)]
    unsafe fn load(row: *const u8, block: usize) -> [__m256; 4] {
        let p = row.add(block * INT4_BLOCK / 2);
        let low = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()));
        let high = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8).cast()));
        let nibble = _mm256_set1_epi32(0x0f);
        [
            _mm256_cvtepi32_ps(_mm256_and_si256(low, nibble)),
            _mm256_cvtepi32_ps(_mm256_and_si256(high, nibble)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(low)),
            _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(high)),
        ]
    }
}

impl Block for Int8 {
    #[inline(always)]
    unsafe fn load(row: *const u8, block: usize) -> [__m256; 4] {
        let p = row.add(block * INT4_BLOCK);
        [widen_i8(p), widen_i8(p.add(8)), widen_i8(p.add(16)), widen_i8(p.add(24))]
    }
}

/// Eight signed bytes at `p` as f32 lanes.
#[inline(always)]
unsafe fn widen_i8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// The sum of four vectors, pairwise.
#[inline(always)]
unsafe fn sum4(v: &[__m256; 4]) -> __m256 {
    _mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3]))
}

impl Weights<'_> {
    /// Weight row `n` dotted with `M` rows of `x` (`stride` apart, each zero-padded to
    /// `k_padded`), scales applied, mins not (the caller adds them from the group sums).
    pub(super) fn row_dot_avx2<const M: usize>(&self, n: usize, x: &[f32], stride: usize) -> [f32; M] {
        let layout = self.layout;
        let scales = &self.scales[n * layout.groups..(n + 1) * layout.groups];
        // SAFETY: the CPU has AVX2 and FMA (the caller checked); the row holds `blocks` whole
        // blocks, `x` holds `M` rows of `k_padded >= 32 * blocks` and `scales` the row's groups.
        let dots = unsafe {
            match self.q {
                QWeight::Int4(q) => {
                    dot::<Int4, M>(q.as_ptr().add(n * layout.row_bytes), x, stride, scales, layout)
                }
                QWeight::Int8(q) => {
                    dot::<Int8, M>(q.as_ptr().add(n * layout.row_bytes).cast(), x, stride, scales, layout)
                }
            }
        };
        std::array::from_fn(|m| dots[m] + self.tail_dot(n, &x[m * stride..]))
    }

    /// Writes row `n`'s dequantized values from column `k0` into `dst` for every whole block
    /// that fits both `dst` and the stored row, below `in_features`; returns the column it
    /// stopped at.
    pub(super) fn decode_row_avx2(&self, n: usize, k0: usize, dst: &mut [f32]) -> usize {
        let layout = self.layout;
        let k_end = (k0 + dst.len()).min(layout.k);
        let blocks = k0 / INT4_BLOCK..(k_end / INT4_BLOCK).min(layout.blocks);
        let groups = n * layout.groups..(n + 1) * layout.groups;
        let (scales, mins) = (&self.scales[groups.clone()], self.mins.map(|m| &m[groups]));
        let done = if blocks.is_empty() { k0 } else { blocks.end * INT4_BLOCK };
        // SAFETY: the CPU has AVX2 and FMA; `blocks` lie in the stored row and, from `k0`, in
        // `dst`; every element they cover is below `in_features`, so its group is in `scales`.
        unsafe {
            let at = |row: *const u8| Decode { row, blocks, scales, mins, group: layout.group };
            match self.q {
                QWeight::Int4(q) => decode::<Int4>(at(q.as_ptr().add(n * layout.row_bytes)), dst),
                QWeight::Int8(q) => decode::<Int8>(at(q.as_ptr().add(n * layout.row_bytes).cast()), dst),
            }
        }
        done
    }
}

/// A row's blocks to decode, with its scales and mins.
struct Decode<'a> {
    row: *const u8,
    blocks: std::ops::Range<usize>,
    scales: &'a [f32],
    mins: Option<&'a [f32]>,
    group: usize,
}

/// `dst[(b - first) * 32 + j] = q · scale + min` for the blocks `b`, eight lanes at a time.
#[target_feature(enable = "avx2,fma")]
unsafe fn decode<B: Block>(d: Decode<'_>, dst: &mut [f32]) {
    let first = d.blocks.start;
    let mut groups = GroupWalk::new(d.group, first * INT4_BLOCK);
    for b in d.blocks.clone() {
        let values = B::load(d.row, b);
        for (h, pair) in values.chunks_exact(2).enumerate() {
            let g = groups.next();
            let scale = _mm256_set1_ps(d.scales[g]);
            let min = _mm256_set1_ps(d.mins.map_or(0.0, |m| m[g]));
            let out = dst.as_mut_ptr().add((b - first) * INT4_BLOCK + h * 16);
            _mm256_storeu_ps(out, _mm256_fmadd_ps(pair[0], scale, min));
            _mm256_storeu_ps(out.add(8), _mm256_fmadd_ps(pair[1], scale, min));
        }
    }
}

/// The group of each successive 16 columns of a row from a column on, counted rather than
/// divided: a division per vector cost the tiles' decoding several times its arithmetic.
pub(crate) struct GroupWalk {
    group: usize,
    /// Runs of 16 columns per group (`usize::MAX` for one group of any width: the whole row).
    per_group: usize,
    left: usize,
}

impl GroupWalk {
    /// Groups are `group` columns wide, a multiple of 16 or the whole row; `from` is a
    /// multiple of 16.
    pub(crate) fn new(group: usize, from: usize) -> Self {
        if !group.is_multiple_of(16) {
            return GroupWalk { group: 0, per_group: usize::MAX, left: usize::MAX };
        }
        let per_group = group / 16;
        GroupWalk { group: from / group, per_group, left: per_group - (from % group) / 16 }
    }

    /// The group of the next 16 columns.
    #[inline(always)]
    pub(crate) fn next(&mut self) -> usize {
        let g = self.group;
        self.left -= 1;
        if self.left == 0 {
            self.group += 1;
            self.left = self.per_group;
        }
        g
    }
}

/// Σ over the row's whole blocks of `q · x · scale`, for `M` rows of `x`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot<B: Block, const M: usize>(
    row: *const u8,
    x: &[f32],
    stride: usize,
    scales: &[f32],
    layout: Layout,
) -> [f32; M] {
    let x = x.as_ptr();
    // Four scaled accumulators per row of x: each group's sum goes into the first two, then
    // the pairs swap, so consecutive groups' multiply-adds do not wait on each other.
    let mut total = [[_mm256_setzero_ps(); 4]; M];
    if layout.group == 16 {
        for b in 0..layout.blocks {
            let mut acc = [[[_mm256_setzero_ps(); 4]; 1]; M];
            products::<B, M, 1>(row, b, x, stride, 0, &mut acc);
            // Elements 0-15 are group 2b, 16-31 group 2b + 1 (past the last group only in
            // an int4 row's padding, where x is zero).
            let high = scales.get(2 * b + 1).copied().unwrap_or(0.0);
            let (s0, s1) = (_mm256_set1_ps(scales[2 * b]), _mm256_set1_ps(high));
            for (t, a) in total.iter_mut().zip(&acc) {
                let [a] = a;
                let low = _mm256_fmadd_ps(_mm256_add_ps(a[0], a[1]), s0, t[0]);
                let high = _mm256_fmadd_ps(_mm256_add_ps(a[2], a[3]), s1, t[1]);
                *t = [t[2], t[3], low, high];
            }
        }
    } else {
        let per_group = if layout.groups == 1 { layout.blocks } else { layout.group / INT4_BLOCK };
        for (g, &scale) in scales.iter().enumerate() {
            let blocks = g * per_group..((g + 1) * per_group).min(layout.blocks);
            let sums = group_sums::<B, M>(row, blocks, x, stride);
            let s = _mm256_set1_ps(scale);
            for (t, sum) in total.iter_mut().zip(sums) {
                let scaled = _mm256_fmadd_ps(sum, s, t[0]);
                *t = [t[1], t[2], t[3], scaled];
            }
        }
    }
    let mut dots = [0.0; M];
    for (dot, t) in dots.iter_mut().zip(&total) {
        *dot = sum8(sum4(t));
    }
    dots
}

/// Σ over `blocks` of `q · x` for each of `M` rows of `x`, as one vector per row. One row keeps
/// two blocks in flight (eight accumulators), two rows one each.
#[inline(always)]
unsafe fn group_sums<B: Block, const M: usize>(
    row: *const u8,
    blocks: std::ops::Range<usize>,
    x: *const f32,
    stride: usize,
) -> [__m256; M] {
    if M == 1 {
        let mut acc = [[[_mm256_setzero_ps(); 4]; 2]; M];
        let mut b = blocks.start;
        while b + 2 <= blocks.end {
            products::<B, M, 2>(row, b, x, stride, 0, &mut acc);
            products::<B, M, 2>(row, b + 1, x, stride, 1, &mut acc);
            b += 2;
        }
        if b < blocks.end {
            products::<B, M, 2>(row, b, x, stride, 0, &mut acc);
        }
        let mut sums = [_mm256_setzero_ps(); M];
        for (sum, [a, c]) in sums.iter_mut().zip(&acc) {
            *sum = _mm256_add_ps(sum4(a), sum4(c));
        }
        sums
    } else {
        let mut acc = [[[_mm256_setzero_ps(); 4]; 1]; M];
        for b in blocks {
            products::<B, M, 1>(row, b, x, stride, 0, &mut acc);
        }
        let mut sums = [_mm256_setzero_ps(); M];
        for (sum, [a]) in sums.iter_mut().zip(&acc) {
            *sum = sum4(a);
        }
        sums
    }
}

/// Adds block `b`'s products with each row of `x` into accumulator set `u`.
#[inline(always)]
unsafe fn products<B: Block, const M: usize, const U: usize>(
    row: *const u8,
    b: usize,
    x: *const f32,
    stride: usize,
    u: usize,
    acc: &mut [[[__m256; 4]; U]; M],
) {
    let values = B::load(row, b);
    for (m, sets) in acc.iter_mut().enumerate() {
        let xb = x.add(m * stride + b * INT4_BLOCK);
        for (i, a) in sets[u].iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(values[i], _mm256_loadu_ps(xb.add(8 * i)), *a);
        }
    }
}
