//! The prefill kernel in AVX-512 intrinsics.
//!
//! A tile is [`ROWS`] query rows of one KV head (a row is a query token × one of the query heads
//! sharing that KV head) and goes over its visible keys in blocks of [`KEYS`]:
//!
//! - scores: `ROWS x KEYS` in 24 registers, each multiply-add a query element broadcast against
//!   sixteen keys' elements (the keys transposed per call, so a head-dimension step is four
//!   contiguous vectors);
//! - online softmax per row: the block's maximum, the rescaling of what came before, the
//!   exponentials in 16 lanes; positions a row must not see (later tokens, outside the sliding
//!   window, padding past the context) are masked in the blocks that hold any;
//! - values: the tile's `ROWS x 64`-column output in 24 registers, each value row multiplied in
//!   with its weights broadcast, read where it lies in the cache.

use std::arch::x86_64::*;
use std::ops::Range;

use super::Job;
use crate::simd::{has_avx512f, Lanes, LN2_HI, LN2_LO};

/// Query rows per tile: 6 × [`KEY_VECTORS`] score accumulators and 6 × [`DIM_VECTORS`] output
/// accumulators, each 24 of the 32 registers.
const ROWS: usize = 6;
const LANES: usize = 16;
const KEY_VECTORS: usize = 4;
/// Keys per softmax block.
const KEYS: usize = KEY_VECTORS * LANES;
const DIM_VECTORS: usize = 4;
/// Head-dimension columns per value run.
const DIM_RUN: usize = DIM_VECTORS * LANES;

pub(super) fn supports(head_dim: usize) -> bool {
    head_dim > 0 && head_dim.is_multiple_of(DIM_RUN) && has_avx512f()
}

/// The context a thread's query positions see: keys transposed, and each position's slot.
struct Context {
    /// The first position held, a multiple of [`KEYS`]; blocks start here.
    start: usize,
    /// Columns per `keys_t` row: the positions held rounded up to whole blocks.
    stride: usize,
    /// `[kv_heads, head_dim, stride]` f32; padding columns are zero.
    keys_t: Vec<f32>,
    /// Element offset of each held position's slot in the caches: positions
    /// `start..start + slots.len()`.
    slots: Vec<usize>,
}

/// Writes the rows of query positions `positions` (chunk indices) to `out`.
///
/// # Safety
/// `supports(head_dim)` must hold and `job` must have been validated (`super::validate`).
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn attend<T: Lanes>(job: &Job<'_, T>, positions: Range<usize>, out: &mut [T]) {
    let s = &job.shape;
    let first = s.num_computed + positions.start;
    let last = s.num_computed + positions.end - 1;
    let start = job.options.visible(first).start / KEYS * KEYS;
    let context = gather_keys(job, start..last + 1);
    let group = s.num_heads / s.num_kv_heads;
    let rows = positions.len() * group;
    let mut queries = vec![0.0f32; rows * s.head_dim];
    let mut state = TileState::new(s.head_dim);
    for kv_head in 0..s.num_kv_heads {
        gather_queries(job, kv_head, positions.clone(), &mut queries);
        for tile_start in (0..rows).step_by(ROWS) {
            // A short last tile repeats its last row; only real rows are written.
            let row = |r: usize| (tile_start + r).min(rows - 1);
            let tile = Tile {
                queries: std::array::from_fn(|r| queries.as_ptr().add(row(r) * s.head_dim)),
                pos: std::array::from_fn(|r| first + row(r) / group),
                kv_head,
            };
            state.run(job, &context, &tile);
            for r in 0..ROWS.min(rows - tile_start) {
                let (token, head) = ((tile_start + r) / group, kv_head * group + (tile_start + r) % group);
                state.write_row(r, &mut out[(token * s.num_heads + head) * s.head_dim..][..s.head_dim]);
            }
        }
    }
}

/// The keys of positions `range`, transposed per KV head, and every position's slot.
#[target_feature(enable = "avx512f")]
unsafe fn gather_keys<T: Lanes>(job: &Job<'_, T>, range: Range<usize>) -> Context {
    let (dim, kv_heads) = (job.shape.head_dim, job.shape.num_kv_heads);
    let stride = range.len().div_ceil(KEYS) * KEYS;
    let slots: Vec<usize> = range.clone().map(|t| job.slot(t)).collect();
    let mut keys_t = vec![0.0f32; kv_heads * dim * stride];
    for (i, &slot) in slots.iter().enumerate() {
        let keys = &job.inputs.key_cache[slot..][..kv_heads * dim];
        for (row, k) in keys.iter().enumerate() {
            *keys_t.get_unchecked_mut(row * stride + i) = k.to_f32();
        }
    }
    Context { start: range.start, stride, keys_t, slots }
}

/// `queries[(token * group + j) * dim ..]`: query head `kv_head * group + j` of each token in
/// `positions`, in f32, times the scale.
fn gather_queries<T: Lanes>(job: &Job<'_, T>, kv_head: usize, positions: Range<usize>, queries: &mut [f32]) {
    let s = &job.shape;
    let group = s.num_heads / s.num_kv_heads;
    let heads_len = group * s.head_dim;
    for (token, dst) in positions.zip(queries.chunks_exact_mut(heads_len)) {
        let src = &job.inputs.query[(token * s.num_heads + kv_head * group) * s.head_dim..][..heads_len];
        for (d, q) in dst.iter_mut().zip(src) {
            *d = q.to_f32() * job.options.scale;
        }
    }
}

/// One tile's rows: their scaled queries and positions, all of one KV head.
struct Tile {
    queries: [*const f32; ROWS],
    pos: [usize; ROWS],
    kv_head: usize,
}

/// A tile's running softmax and output, reused from tile to tile.
struct TileState {
    dim: usize,
    /// Each row's largest score so far.
    max: [f32; ROWS],
    /// Each row's sum of `exp(score - max)` so far.
    sum: [f32; ROWS],
    /// `[ROWS, dim]` unnormalized output.
    out: Vec<f32>,
    /// `[ROWS, KEYS]` the block's weights.
    weights: [f32; ROWS * KEYS],
    /// What each row's earlier output is multiplied by for this block.
    rescale: [f32; ROWS],
}

impl TileState {
    fn new(dim: usize) -> Self {
        TileState {
            dim,
            max: [f32::NEG_INFINITY; ROWS],
            sum: [0.0; ROWS],
            out: vec![0.0; ROWS * dim],
            weights: [0.0; ROWS * KEYS],
            rescale: [1.0; ROWS],
        }
    }

    /// The tile over every block of keys any of its rows sees.
    #[target_feature(enable = "avx512f")]
    unsafe fn run<T: Lanes>(&mut self, job: &Job<'_, T>, context: &Context, tile: &Tile) {
        self.max = [f32::NEG_INFINITY; ROWS];
        self.sum = [0.0; ROWS];
        self.out.fill(0.0);
        let lo = tile.pos.map(|p| job.options.visible(p).start);
        // Rows go in position order, so the first row sees the earliest keys and the last the latest.
        let (first_block, last_block) =
            ((lo[0] - context.start) / KEYS, (tile.pos[ROWS - 1] - context.start) / KEYS);
        let (lo_max, pos_min) = (lo[ROWS - 1], tile.pos[0]);
        let keys_t = context.keys_t.as_ptr().add(tile.kv_head * self.dim * context.stride);
        for block in first_block..=last_block {
            let base = context.start + block * KEYS;
            // The vectors of keys some row sees: the diagonal block's later ones are skipped.
            let vectors = KEY_VECTORS.min((tile.pos[ROWS - 1] - base) / LANES + 1);
            let keys_t = keys_t.add(block * KEYS);
            let scores = match vectors {
                1 => scores::<1>(&tile.queries, keys_t, context.stride, self.dim),
                2 => scores::<2>(&tile.queries, keys_t, context.stride, self.dim),
                3 => scores::<3>(&tile.queries, keys_t, context.stride, self.dim),
                _ => scores::<KEY_VECTORS>(&tile.queries, keys_t, context.stride, self.dim),
            };
            let masked = base < lo_max || base + KEYS - 1 > pos_min;
            for (r, scores) in scores.iter().enumerate() {
                let visible =
                    if masked { visible_lanes(base, lo[r]..tile.pos[r] + 1) } else { [!0; KEY_VECTORS] };
                self.softmax_row(r, scores, visible);
            }
            let tokens = (vectors * LANES).min(context.slots.len() - block * KEYS);
            let offset = tile.kv_head * self.dim;
            let rows =
                |t: usize| job.inputs.value_cache.as_ptr().add(context.slots[block * KEYS + t] + offset);
            for col in (0..self.dim).step_by(DIM_RUN) {
                self.add_values(tokens, |t| rows(t).add(col), col);
            }
        }
    }

    /// Folds row `r`'s block of scores into its running softmax; leaves the block's weights
    /// in `weights` and the factor for the row's earlier output in `rescale`.
    #[inline(always)]
    unsafe fn softmax_row(
        &mut self,
        r: usize,
        scores: &[__m512; KEY_VECTORS],
        visible: [__mmask16; KEY_VECTORS],
    ) {
        let neg_inf = _mm512_set1_ps(f32::NEG_INFINITY);
        let scores: [__m512; KEY_VECTORS] =
            std::array::from_fn(|v| _mm512_mask_blend_ps(visible[v], neg_inf, scores[v]));
        let block_max = _mm512_reduce_max_ps(scores.iter().fold(neg_inf, |m, s| _mm512_max_ps(m, *s)));
        let max = self.max[r].max(block_max);
        let weights = &mut self.weights[r * KEYS..][..KEYS];
        if max == f32::NEG_INFINITY {
            // Nothing visible yet (a sliding window that starts past this block).
            weights.fill(0.0);
            self.rescale[r] = 1.0;
            return;
        }
        self.rescale[r] = (self.max[r] - max).exp();
        self.max[r] = max;
        let mut total = _mm512_setzero_ps();
        for (v, s) in scores.iter().enumerate() {
            let e = _mm512_maskz_mov_ps(visible[v], exp16(_mm512_sub_ps(*s, _mm512_set1_ps(max))));
            _mm512_storeu_ps(weights.as_mut_ptr().add(v * LANES), e);
            total = _mm512_add_ps(total, e);
        }
        self.sum[r] = self.sum[r] * self.rescale[r] + _mm512_reduce_add_ps(total);
    }

    /// `out[r, col..col + 64] = out * rescale[r] + Σ_t weights[r, t] · value_t`, value row `t`
    /// (its columns `col..`) at `row(t)`.
    #[inline(always)]
    unsafe fn add_values<T: Lanes>(&mut self, tokens: usize, row: impl Fn(usize) -> *const T, col: usize) {
        let out = self.out.as_mut_ptr().add(col);
        let mut acc: [[__m512; DIM_VECTORS]; ROWS] = std::array::from_fn(|r| {
            let rescale = _mm512_set1_ps(self.rescale[r]);
            std::array::from_fn(|i| {
                _mm512_mul_ps(_mm512_loadu_ps(out.add(r * self.dim + i * LANES)), rescale)
            })
        });
        for t in 0..tokens {
            let value: [__m512; DIM_VECTORS] = std::array::from_fn(|i| T::load16(row(t).add(i * LANES)));
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_set1_ps(*self.weights.get_unchecked(r * KEYS + t));
                for (a, v) in acc.iter_mut().zip(&value) {
                    *a = _mm512_fmadd_ps(w, *v, *a);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            for (i, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(r * self.dim + i * LANES), *a);
            }
        }
    }

    /// Row `r`'s output, normalized, into `dst` (`head_dim` elements).
    fn write_row<T: Lanes>(&self, r: usize, dst: &mut [T]) {
        let inv = 1.0 / self.sum[r];
        for (d, o) in dst.iter_mut().zip(&self.out[r * self.dim..][..self.dim]) {
            *d = T::from_f32(o * inv);
        }
    }
}

/// `q_r · k_t` for the tile's rows and the first `V` vectors of the [`KEYS`] keys from `keys_t`
/// on (columns of the transposed keys, rows `stride` apart); the vectors past `V` are zero.
#[inline(always)]
unsafe fn scores<const V: usize>(
    queries: &[*const f32; ROWS],
    keys_t: *const f32,
    stride: usize,
    dim: usize,
) -> [[__m512; KEY_VECTORS]; ROWS] {
    let mut acc = [[_mm512_setzero_ps(); KEY_VECTORS]; ROWS];
    for d in 0..dim {
        let keys: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(keys_t.add(d * stride + v * LANES)));
        for (acc, q) in acc.iter_mut().zip(queries) {
            let q = _mm512_set1_ps(*q.add(d));
            for (a, k) in acc[..V].iter_mut().zip(&keys) {
                *a = _mm512_fmadd_ps(q, *k, *a);
            }
        }
    }
    acc
}

/// Which lanes of a block starting at position `base` fall in `visible`.
#[inline(always)]
unsafe fn visible_lanes(base: usize, visible: Range<usize>) -> [__mmask16; KEY_VECTORS] {
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Positions fit i32: a context is far below 2^31 tokens.
    let (lo, hi) = (_mm512_set1_epi32(visible.start as i32), _mm512_set1_epi32(visible.end as i32));
    std::array::from_fn(|v| {
        let pos = _mm512_add_epi32(lanes, _mm512_set1_epi32((base + v * LANES) as i32));
        _mm512_cmpge_epi32_mask(pos, lo) & _mm512_cmplt_epi32_mask(pos, hi)
    })
}

/// `e^x` in 16 lanes for `x <= 0` (within a few ulp): `x = n ln2 + r`, a degree-6 polynomial
/// in `r`, then `scalef` multiplies by `2^n`, which underflows to 0 as `e^x` does.
#[inline(always)]
unsafe fn exp16(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}
