//! The decode kernel in AVX-512 intrinsics, for head sizes that are a multiple of 16.
//!
//! With grouped-query attention a decode row does several multiply-adds per byte of cache it
//! reads (Qwen2-0.5B: 14 query heads over 2 KV heads of 64, 3.5 flops per byte), so the kernel
//! must keep the FMA units busy as well as the memory. Two passes over a request's context:
//!
//! - scores: for each query head, sixteen tokens at a time, each token's dot product as one
//!   16-lane partial sum over the head dimension; the sixteen sums are folded into one register of
//!   sixteen scores by a tree of shuffles and adds (about three instructions per dot product,
//!   against four multiply-adds at head size 64). The keys are read once, for all KV heads of a
//!   token together, and the keys and values of the tiles ahead are requested meanwhile;
//! - values: straight from the cache, no copy. The query heads sharing a KV head go in passes of
//!   up to [`MAX_HEADS`] heads and [`MAX_ACCUMULATORS`] accumulators, which stay in registers
//!   while every value row is multiplied in with its softmax weight broadcast. The passes after
//!   the first (other KV heads, other columns) find the rows in L2.
//!
//! Measured on the development machine (2 threads, fp32, 14 query / 2 KV heads of 64, the 24
//! layers of a Qwen2-0.5B step, caches in memory, shuffled blocks), ms per step, the AVX2 kernel
//! before -> this one: 64 requests of 400 tokens 95 -> 38; 32 of 300, 26 -> 16; 8 of 400,
//! 12 -> 5.1; one of 100, 0.41 -> 0.56 (a step's attention is then ~0.7% of its time).

use std::arch::x86_64::*;

use super::{Softmax, Unit};
use crate::element::Element;
use crate::simd::{has_avx512f, prefetch_l2, Lanes};

/// Tokens per score tile: one register of scores.
const TOKENS: usize = 16;
/// Query heads per value pass (Qwen2's group).
const MAX_HEADS: usize = 7;
/// Accumulators of a value pass, at most: with the value vectors and the broadcast weight they
/// fit the 32 registers (28 did not: the compiler spilled them).
const MAX_ACCUMULATORS: usize = 24;
/// Head-dimension vectors per score or value run.
const MAX_VECTORS: usize = 4;
/// Lanes of one vector.
const LANES: usize = 16;
/// How far ahead (in tokens) the score pass requests keys and values, and a value pass its rows,
/// into L2. Measured on the development machine (64 requests of 400 tokens, 24 layers, caches in
/// memory): requests into L1 a tile ahead, 68 ms per step; into L2 as here, 38-43 ms; 64/96
/// ahead, 47 ms. One core then reads ~10 GB/s and two ~15 GB/s, against ~31 GB/s with the caches
/// in L3, so the wait on memory is what is left.
const KEYS_AHEAD: usize = 32;
const VALUES_AHEAD: usize = 48;
const ROWS_AHEAD: usize = 64;

/// Whether [`attend`] takes this head size on this CPU.
pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(LANES) && has_avx512f()
}

/// Writes the request's `num_heads x head_dim` outputs.
///
/// # Safety
/// `supports(unit.dim)` must hold, and `unit` must address readable rows (as [`Unit`] promises
/// once built from validated inputs).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend<T: Element, C: Lanes>(
    unit: &Unit<'_, C>,
    soft_cap: Option<f32>,
    out: &mut [T],
) -> Vec<f32> {
    let (n, heads, dim, group) = (unit.slots.len(), unit.kv_heads * unit.group, unit.dim, unit.group);
    let padded = n.div_ceil(TOKENS) * TOKENS;
    let mut scores = vec![0.0f32; heads * padded];
    score_all(unit, &mut scores, padded);
    let softmax = Softmax::of(&mut scores, padded, n, heads, soft_cap, unit.value_scale);
    let totals = &softmax.totals;
    for kv_head in 0..unit.kv_heads {
        let group_end = (kv_head + 1) * group;
        for first in (kv_head * group..group_end).step_by(MAX_HEADS) {
            let heads = MAX_HEADS.min(group_end - first);
            let run = run_length(dim / LANES, (MAX_ACCUMULATORS / heads).min(MAX_VECTORS));
            for col in (0..dim).step_by(run * LANES) {
                let pass = Pass { unit, scores: &scores, padded, totals, first, kv_head, col };
                match run {
                    1 => pass.run_heads::<T, 1>(heads, out),
                    2 => pass.run_heads::<T, 2>(heads, out),
                    3 => pass.run_heads::<T, 3>(heads, out),
                    _ => pass.run_heads::<T, MAX_VECTORS>(heads, out),
                }
            }
        }
    }
    softmax.log_masses
}

/// `scores[h * padded + t] = q_h · k_t` for every query head and every context token. While a
/// tile is scored, the keys [`KEYS_AHEAD`] and the values [`VALUES_AHEAD`] tokens on are
/// requested into L2, a share before each head's dot products so the requests never come in a
/// burst.
#[target_feature(enable = "avx512f")]
unsafe fn score_all<T: Lanes>(unit: &Unit<'_, T>, scores: &mut [f32], padded: usize) {
    let (n, dim, slot_len) = (unit.slots.len(), unit.dim, unit.kv_heads * unit.dim);
    let run = run_length(dim / LANES, MAX_VECTORS);
    let slot =
        |cache: &[T], t: usize| std::slice::from_raw_parts(cache.as_ptr().add(unit.slots[t]), slot_len);
    let mut wide = if T::WIDENS { vec![0.0f32; TOKENS * dim] } else { Vec::new() };
    for t in 0..KEYS_AHEAD.min(n) {
        prefetch_l2(slot(unit.key_cache, t));
    }
    for start in (0..n).step_by(TOKENS) {
        // A short last tile repeats its last token; the scores past `n` are never read.
        let tile: [*const T; TOKENS] =
            std::array::from_fn(|j| slot(unit.key_cache, (start + j).min(n - 1)).as_ptr());
        for kv_head in 0..unit.kv_heads {
            let keys = tile.map(|k| k.add(kv_head * dim));
            let tile = Tile { start, run, heads: kv_head * unit.group..(kv_head + 1) * unit.group };
            if T::WIDENS {
                // Widened once here rather than once per query head of the group.
                for (j, &k) in keys.iter().enumerate() {
                    for c in (0..dim).step_by(LANES) {
                        _mm512_storeu_ps(wide.as_mut_ptr().add(j * dim + c), T::load16(k.add(c)));
                    }
                }
                let keys: [*const f32; TOKENS] = std::array::from_fn(|j| wide.as_ptr().add(j * dim));
                score_heads(unit, &tile, &keys, scores, padded);
            } else {
                score_heads(unit, &tile, &keys, scores, padded);
            }
        }
    }
}

/// Which scores one call of [`score_heads`] fills: tokens `start..start + TOKENS` of the query
/// heads `heads`, `run` vectors of the head dimension at a time.
struct Tile {
    start: usize,
    run: usize,
    heads: std::ops::Range<usize>,
}

/// One tile's scores for its query heads, each preceded by its share of the prefetches.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn score_heads<T: Lanes, K: Lanes>(
    unit: &Unit<'_, T>,
    tile: &Tile,
    keys: &[*const K; TOKENS],
    scores: &mut [f32],
    padded: usize,
) {
    let (n, dim, slot_len) = (unit.slots.len(), unit.dim, unit.kv_heads * unit.dim);
    let (heads, start) = (unit.kv_heads * unit.group, tile.start);
    let slot =
        |cache: &[T], t: usize| std::slice::from_raw_parts(cache.as_ptr().add(unit.slots[t]), slot_len);
    for h in tile.heads.clone() {
        for j in h * TOKENS / heads..(h + 1) * TOKENS / heads {
            if start + KEYS_AHEAD + j < n {
                prefetch_l2(slot(unit.key_cache, start + KEYS_AHEAD + j));
            }
            if start + VALUES_AHEAD + j < n {
                prefetch_l2(slot(unit.value_cache, start + VALUES_AHEAD + j));
            }
        }
        let query = unit.query[h * dim..].as_ptr();
        let sums = match tile.run {
            1 => score_tile::<K, 1>(query, keys, dim),
            2 => score_tile::<K, 2>(query, keys, dim),
            3 => score_tile::<K, 3>(query, keys, dim),
            _ => score_tile::<K, MAX_VECTORS>(query, keys, dim),
        };
        _mm512_storeu_ps(scores.as_mut_ptr().add(h * padded + start), sums);
    }
}

/// The sixteen dot products of one query head with sixteen key rows, as one register: runs of
/// `V` query vectors held in registers, each multiplied into every token's accumulator. Every
/// index into `acc` is a constant once the loops unroll, so the accumulators stay in registers.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn score_tile<T: Lanes, const V: usize>(
    query: *const f32,
    keys: &[*const T; TOKENS],
    dim: usize,
) -> __m512 {
    let mut acc = [_mm512_setzero_ps(); TOKENS];
    for c in (0..dim).step_by(V * LANES) {
        let q: [__m512; V] = std::array::from_fn(|i| _mm512_loadu_ps(query.add(c + i * LANES)));
        for (a, k) in acc.iter_mut().zip(keys) {
            for (i, q) in q.iter().enumerate() {
                *a = _mm512_fmadd_ps(*q, T::load16(k.add(c + i * LANES)), *a);
            }
        }
    }
    fold16(acc)
}

/// The largest run of vectors, at most `cap`, that divides `vectors` into equal runs.
fn run_length(vectors: usize, cap: usize) -> usize {
    (1..=cap.min(vectors)).rev().find(|v| vectors.is_multiple_of(*v)).unwrap_or(1)
}

/// `[sum(a[0]), …, sum(a[15])]`. Each level halves the registers and doubles the sums per
/// register: 256-bit halves, 128-bit quarters, pairs of lanes, then single lanes, which leaves
/// `a[i + 4j]`'s sum in lane `4i + j`; one permutation puts them in order.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn fold16(a: [__m512; TOKENS]) -> __m512 {
    // [x0 in 8 lanes | x1 in 8 lanes]: the low halves of a pair plus their high halves.
    let halves: [__m512; 8] = std::array::from_fn(|k| {
        let (x, y) = (a[2 * k], a[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
        )
    });
    // Four sums in 4 lanes each, one per 128-bit quarter.
    let quarters: [__m512; 4] = std::array::from_fn(|k| {
        let (x, y) = (halves[2 * k], halves[2 * k + 1]);
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    });
    // Quarter i: [a[i] in 2 lanes, a[4 + i] in 2 lanes] (and a[8 + i], a[12 + i] in the second).
    let pairs: [__m512; 2] = std::array::from_fn(|k| {
        // Moved as 64-bit pairs of lanes, added as f32.
        let (x, y) = (_mm512_castps_pd(quarters[2 * k]), _mm512_castps_pd(quarters[2 * k + 1]));
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))
    });
    let (x, y) = (pairs[0], pairs[1]);
    let sums =
        _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(x, y), _mm512_shuffle_ps::<0b11_01_11_01>(x, y));
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(order, sums)
}

/// One value pass: the query heads `first..` (sharing KV head `kv_head`), head-dimension
/// columns `col..`.
struct Pass<'a, C> {
    unit: &'a Unit<'a, C>,
    scores: &'a [f32],
    padded: usize,
    totals: &'a [f32],
    first: usize,
    kv_head: usize,
    col: usize,
}

impl<C: Lanes> Pass<'_, C> {
    /// [`Pass::run`] for `heads` (1 to [`MAX_HEADS`]) query heads.
    #[target_feature(enable = "avx512f")]
    unsafe fn run_heads<T: Element, const V: usize>(&self, heads: usize, out: &mut [T]) {
        match heads {
            1 => self.run::<T, 1, V>(out),
            2 => self.run::<T, 2, V>(out),
            3 => self.run::<T, 3, V>(out),
            4 => self.run::<T, 4, V>(out),
            5 => self.run::<T, 5, V>(out),
            6 => self.run::<T, 6, V>(out),
            _ => self.run::<T, MAX_HEADS, V>(out),
        }
    }

    /// `out[h] = Σ_t scores[h, t] · values[t] / totals[h]` for the pass's `H` heads and `V`
    /// vectors of columns.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<T: Element, const H: usize, const V: usize>(&self, out: &mut [T]) {
        let unit = self.unit;
        let n = unit.slots.len();
        let offset = self.kv_head * unit.dim + self.col;
        let row = |t: usize| unit.value_cache.as_ptr().add(unit.slots[t] + offset);
        let mut acc = [[_mm512_setzero_ps(); V]; H];
        for t in 0..n {
            if t + ROWS_AHEAD < n {
                prefetch_l2(std::slice::from_raw_parts(row(t + ROWS_AHEAD), V * LANES));
            }
            let v: [__m512; V] = std::array::from_fn(|i| C::load16(row(t).add(i * LANES)));
            for (h, acc) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*self.scores.get_unchecked((self.first + h) * self.padded + t));
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = _mm512_fmadd_ps(p, *v, *a);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            let head = self.first + h;
            let inv = _mm512_set1_ps(1.0 / self.totals[head]);
            for (i, a) in acc.iter().enumerate() {
                let mut lanes = [0.0f32; LANES];
                _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_mul_ps(*a, inv));
                let start = head * unit.dim + self.col + i * LANES;
                for (o, l) in out[start..][..LANES].iter_mut().zip(lanes) {
                    *o = T::from_f32(l);
                }
            }
        }
    }
}
