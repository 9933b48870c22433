//! The decode kernel in AVX2/FMA intrinsics, for head sizes that are a multiple of 16.
//!
//! The portable kernel transposes each tile of keys element by element (a scalar store per key
//! element) and adds every value row into the group's accumulators in memory; both cost more
//! than the multiply-adds. Here nothing is transposed and the accumulators stay in registers:
//!
//! - scores: for each query head, eight tokens at a time, one 8-lane partial sum per token over
//!   the head dimension, then the eight sums folded into one register of eight scores by a tree
//!   of horizontal adds (10 instructions per 64 multiply-adds at head size 64);
//! - values: first copied into f32 rows laid end to end per KV head, then the heads sharing a KV
//!   head in blocks of [`HEADS_PER_PASS`], 16 dimensions at a time, every row multiplied in with
//!   its softmax weight broadcast, so a pass keeps its 2 × heads accumulators in registers.
//!
//! Measured on the development machine (2 threads, fp32, 14 query / 2 KV heads of 64, the 24
//! layers of a Qwen2-0.5B step, caches in memory, shuffled blocks): 56 requests of 450 tokens
//! 100-113 -> 70-82 ms per step; 32 of 200, 21-38 -> 15-19 ms; one of 100, 0.66 -> 0.43 ms.
//! That is ~10 GB/s of cache read, a third of what a plain sum streams: most of the rest is
//! waiting on rows, which software prefetch (here, or not at all) did not change.

use std::arch::x86_64::*;

use super::{Softmax, Unit};
use crate::element::Element;
use crate::simd::{prefetch, Lanes};

/// Query heads whose weighted value sums one pass accumulates: 2 registers each, 8 in all, with
/// the two value registers and the broadcast weight well inside AVX2's 16.
const HEADS_PER_PASS: usize = 4;
/// Tokens whose scores one register holds.
const TOKENS: usize = 8;
/// Value rows requested ahead of the one being copied. The copy does little per row, so the
/// request must go out far ahead to arrive in time (8 rows ahead measured ~25% slower).
const PREFETCH_AHEAD: usize = 32;

/// Whether [`attend`] takes this head size.
pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(16)
}

/// Writes the request's `num_heads x head_dim` outputs.
///
/// # Safety
/// The CPU must have AVX2 and FMA, `supports(unit.dim)` must hold, and `unit` must address
/// readable rows (as [`Unit`] promises once built from validated inputs).
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn attend<T: Element, C: Lanes>(
    unit: &Unit<'_, C>,
    soft_cap: Option<f32>,
    out: &mut [T],
) -> Vec<f32> {
    let (n, heads, dim) = (unit.slots.len(), unit.kv_heads * unit.group, unit.dim);
    let padded = n.div_ceil(TOKENS) * TOKENS;
    let mut scores = vec![0.0f32; heads * padded];
    score_all(unit, &mut scores, padded);
    let softmax = Softmax::of(&mut scores, padded, n, heads, soft_cap, unit.value_scale);
    let totals = &softmax.totals;
    let values = gather_values(unit);
    for (kv_head, values) in values.chunks_exact(n * dim).enumerate() {
        for first in (kv_head * unit.group..(kv_head + 1) * unit.group).step_by(HEADS_PER_PASS) {
            let pass = Pass { values, dim, scores: &scores, padded, first, totals };
            match (kv_head + 1) * unit.group - first {
                1 => pass.run::<T, 1>(out),
                2 => pass.run::<T, 2>(out),
                3 => pass.run::<T, 3>(out),
                _ => pass.run::<T, HEADS_PER_PASS>(out),
            }
        }
    }
    softmax.log_masses
}

/// `scores[h * padded + t] = q_h · k_t` for every query head and every context token. Tiles of
/// eight tokens; a tile's keys for all KV heads are one contiguous run of each slot, requested
/// a tile ahead.
#[target_feature(enable = "avx2,fma")]
unsafe fn score_all<C: Lanes>(unit: &Unit<'_, C>, scores: &mut [f32], padded: usize) {
    let (n, dim, slot_len) = (unit.slots.len(), unit.dim, unit.kv_heads * unit.dim);
    let slot = |t: usize| unit.key_cache.as_ptr().add(unit.slots[t]);
    let mut wide = if C::WIDENS { vec![0.0f32; TOKENS * dim] } else { Vec::new() };
    for t in 0..TOKENS.min(n) {
        prefetch(std::slice::from_raw_parts(slot(t), slot_len));
    }
    for start in (0..n).step_by(TOKENS) {
        for t in (start + TOKENS..n).take(TOKENS) {
            prefetch(std::slice::from_raw_parts(slot(t), slot_len));
        }
        // A short last tile repeats its last token; the scores past `n` are never read.
        let tile: [*const C; TOKENS] = std::array::from_fn(|j| slot((start + j).min(n - 1)));
        for kv_head in 0..unit.kv_heads {
            let keys = tile.map(|k| k.add(kv_head * dim));
            let heads = kv_head * unit.group..(kv_head + 1) * unit.group;
            if C::WIDENS {
                // Widened once here rather than once per query head of the group.
                for (j, &k) in keys.iter().enumerate() {
                    for c in (0..dim).step_by(8) {
                        _mm256_storeu_ps(wide.as_mut_ptr().add(j * dim + c), C::load8(k.add(c)));
                    }
                }
                let keys: [*const f32; TOKENS] = std::array::from_fn(|j| wide.as_ptr().add(j * dim));
                score_heads(unit, heads, &keys, &mut scores[start..], padded);
            } else {
                score_heads(unit, heads, &keys, &mut scores[start..], padded);
            }
        }
    }
}

/// One tile's scores for the query heads `heads`, at `scores[h * padded]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn score_heads<C: Lanes, K: Lanes>(
    unit: &Unit<'_, C>,
    heads: std::ops::Range<usize>,
    keys: &[*const K; TOKENS],
    scores: &mut [f32],
    padded: usize,
) {
    let dim = unit.dim;
    for h in heads {
        let tile = score_tile(unit.query[h * dim..].as_ptr(), keys, dim);
        _mm256_storeu_ps(scores.as_mut_ptr().add(h * padded), tile);
    }
}

/// The eight dot products of one query head with eight key rows, as one register.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn score_tile<T: Lanes>(query: *const f32, keys: &[*const T; TOKENS], dim: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); TOKENS];
    for c in (0..dim).step_by(8) {
        let q = _mm256_loadu_ps(query.add(c));
        for (a, k) in acc.iter_mut().zip(keys) {
            *a = _mm256_fmadd_ps(q, T::load8(k.add(c)), *a);
        }
    }
    fold8(acc)
}

/// `[sum(a[0]), …, sum(a[7])]`: pairwise horizontal adds, then the two 128-bit halves added.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fold8(a: [__m256; TOKENS]) -> __m256 {
    let q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    let q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    // q0 holds [a0, a1, a2, a3] low-half sums then their high-half sums; q1 the same for a4..a7.
    let low = _mm256_permute2f128_ps::<0x20>(q0, q1);
    let high = _mm256_permute2f128_ps::<0x31>(q0, q1);
    _mm256_add_ps(low, high)
}

/// The request's values widened to f32, `[kv_heads, n, head_dim]`: each KV head's rows end to
/// end, so the value passes read one sequential stream the hardware prefetcher follows, instead
/// of rows scattered over the cache's blocks that missed L1 on every pass (those loads took half
/// of the kernel's time). Each slot is read once, all heads together.
#[target_feature(enable = "avx2,fma")]
unsafe fn gather_values<C: Lanes>(unit: &Unit<'_, C>) -> Vec<f32> {
    let (n, dim, slot_len) = (unit.slots.len(), unit.dim, unit.kv_heads * unit.dim);
    let slot = |t: usize| unit.value_cache.as_ptr().add(unit.slots[t]);
    let mut values = vec![0.0f32; unit.kv_heads * n * dim];
    for t in 0..PREFETCH_AHEAD.min(n) {
        prefetch(std::slice::from_raw_parts(slot(t), slot_len));
    }
    for t in 0..n {
        if t + PREFETCH_AHEAD < n {
            prefetch(std::slice::from_raw_parts(slot(t + PREFETCH_AHEAD), slot_len));
        }
        for kv_head in 0..unit.kv_heads {
            let (src, dst) = (slot(t).add(kv_head * dim), values.as_mut_ptr().add((kv_head * n + t) * dim));
            for c in (0..dim).step_by(8) {
                _mm256_storeu_ps(dst.add(c), C::load8(src.add(c)));
            }
        }
    }
    values
}

/// One value pass: the heads `first..first + H` (sharing one KV head, whose `n x dim` values are
/// `values`), 16 dimensions at a time.
struct Pass<'a> {
    values: &'a [f32],
    dim: usize,
    scores: &'a [f32],
    padded: usize,
    first: usize,
    totals: &'a [f32],
}

impl Pass<'_> {
    /// `out[h] = Σ_t scores[h, t] · values[t] / totals[h]` for the pass's `H` heads.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run<T: Element, const H: usize>(&self, out: &mut [T]) {
        let (dim, first) = (self.dim, self.first);
        let n = self.values.len() / dim;
        for c in (0..dim).step_by(16) {
            let mut acc = [[_mm256_setzero_ps(); 2]; H];
            for t in 0..n {
                let v = self.values.as_ptr().add(t * dim + c);
                let (v0, v1) = (_mm256_loadu_ps(v), _mm256_loadu_ps(v.add(8)));
                for (h, pair) in acc.iter_mut().enumerate() {
                    let p = _mm256_broadcast_ss(self.scores.get_unchecked((first + h) * self.padded + t));
                    pair[0] = _mm256_fmadd_ps(p, v0, pair[0]);
                    pair[1] = _mm256_fmadd_ps(p, v1, pair[1]);
                }
            }
            for (h, pair) in acc.iter().enumerate() {
                let inv = _mm256_set1_ps(1.0 / self.totals[first + h]);
                let mut lanes = [0.0f32; 16];
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(pair[0], inv));
                _mm256_storeu_ps(lanes.as_mut_ptr().add(8), _mm256_mul_ps(pair[1], inv));
                for (o, l) in out[(first + h) * dim + c..][..16].iter_mut().zip(lanes) {
                    *o = T::from_f32(l);
                }
            }
        }
    }
}
