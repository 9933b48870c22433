//! The GEMM in AVX-512 intrinsics.
//!
//! A thread runs the tiles it claims (one panel's columns, 1-3 vectors, for one slab of rows:
//! `super::Tiles`); in a tile, the panel rows go by in chunks of [`K_CHUNK`], and every
//! [`ROW_BLOCK`]-row block of the slab multiplies the chunk into its accumulators, which live in
//! registers for the chunk and in `out` between chunks. The first block takes the chunk from
//! memory; the blocks between them prefetch the next chunk (or the thread's next tile), a line
//! per panel row, so the next first block finds it in cache.
//!
//! A slab of one row (a batch-1 decode step) takes [`one_row`] instead: it streams each panel
//! once, start to end, asking for it ahead (on AMD as non-temporal, so the stream does not flush L3).
//!
//! [`run_gated`] runs a gate tile and the matching up tile into two scratch tiles, then writes
//! `silu(gate) * up` from them: the gated MLP's product never leaves L2.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Job, Tiles, LANES, PANEL_WIDTH, ROW_BLOCK};
use crate::activation::silu_mul;

/// Panel rows per chunk: 128 × 48 × 4 B = 24 KB, inside the 32 KB L1 with the blocks' `x`.
/// Measured 64: 120 ms, 96: 126, 128: 116-133, 160: 115, 256: 127, 896: 124 for the 32-row step.
const K_CHUNK: usize = 128;
const LINE: usize = 64;

pub(super) fn available() -> bool {
    crate::simd::has_avx512f()
}

/// A run of output columns inside one panel.
#[derive(Clone, Copy)]
struct Tile {
    /// The tile's first column in panel row 0.
    weight: *const f32,
    /// The panel's width: the distance between its rows.
    stride: usize,
    /// The tile's first output column.
    col: usize,
    /// Lanes of the last vector that are real columns.
    mask: __mmask16,
    /// The next panel's first element, to prefetch during the last chunk.
    next: *const f32,
}

/// Where a tile's results go: the tile's first column of row `r` is at `ptr + r * stride`.
#[derive(Clone, Copy)]
struct Target {
    ptr: *mut f32,
    stride: usize,
}

impl Target {
    fn row(&self, r: usize) -> *mut f32 {
        self.ptr.wrapping_add(r * self.stride)
    }
}

impl Tile {
    /// The columns `cols`, which lie inside one panel of `job`'s weight; its last chunk
    /// prefetches the start of `then`'s columns (the thread's next tile), else the next panel.
    unsafe fn new(job: &Job<'_>, cols: Range<usize>, then: Option<&Range<usize>>) -> Self {
        let panels = job.panels;
        let (panel, within) = (cols.start / PANEL_WIDTH, cols.start % PANEL_WIDTH);
        debug_assert!(within + cols.len() <= panels.width(panel), "{cols:?} crosses a panel");
        let tail = cols.len() - (cols.len().div_ceil(LANES) - 1) * LANES;
        let next = then.map_or(panels.offset(panel + 1), |then| panels.index(then.start, 0));
        Tile {
            weight: job.packed.as_ptr().add(panels.offset(panel) + within),
            stride: panels.width(panel),
            col: cols.start,
            mask: if tail == LANES { !0 } else { (1 << tail) - 1 },
            next: job.packed.as_ptr().wrapping_add(next),
        }
    }
}

/// # Safety
/// As [`Job::run`]; the CPU has AVX-512F and `in_features > 0`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn run(job: &Job<'_>, tiles: &Tiles, thread: usize, out: *mut f32) {
    tiles.claim_each(thread, |rows, cols, then| {
        let target = Target { ptr: out.add(cols.start), stride: job.panels.out_features };
        pass(job, Tile::new(job, cols.clone(), then.as_ref()), cols.len(), rows, target);
    });
}

/// [`super::gemm_silu_mul`]'s share of thread `thread`: for each tile it claims, the gate's and
/// the up's products into two scratch tiles that stay in L2, then `silu(gate) * up` into `out`
/// (`width` columns).
///
/// # Safety
/// As [`run`], for both jobs, which have the same shape; `out` addresses `rows * width` elements.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn run_gated(gate: &Job<'_>, up: &Job<'_>, tiles: &Tiles, thread: usize, out: *mut f32) {
    let width = gate.panels.out_features;
    let tile_len = tiles.slab * PANEL_WIDTH;
    let mut scratch = vec![0.0f32; 2 * tile_len];
    let (g, u) = scratch.split_at_mut(tile_len);
    tiles.claim_each(thread, |rows, cols, then| {
        // Row `r` of the slab lands at `(r - rows.start) * PANEL_WIDTH` of a scratch tile.
        let into = |buf: &mut [f32]| Target {
            ptr: buf.as_mut_ptr().wrapping_sub(rows.start * PANEL_WIDTH),
            stride: PANEL_WIDTH,
        };
        let (tile_g, tile_u) =
            (Tile::new(gate, cols.clone(), then.as_ref()), Tile::new(up, cols.clone(), None));
        // Each pass prefetches what comes after it: the up tile, then the gate's next tile.
        let span = cols.len();
        pass(gate, Tile { next: tile_u.weight, ..tile_g }, span, rows.clone(), into(g));
        pass(up, Tile { next: tile_g.next, ..tile_u }, span, rows.clone(), into(u));
        for r in 0..rows.len() {
            let at = r * PANEL_WIDTH;
            let dst = std::slice::from_raw_parts_mut(out.add((rows.start + r) * width + cols.start), span);
            silu_mul(&g[at..at + span], &u[at..at + span], dst);
        }
    });
}

/// One tile of `job` for `rows`, into `target`.
#[inline(always)]
unsafe fn pass(job: &Job<'_>, tile: Tile, span: usize, rows: Range<usize>, target: Target) {
    match (rows.len(), span.div_ceil(LANES)) {
        (1, v) if crate::simd::is_amd() => match v {
            3 => one_row::<3, _MM_HINT_NTA, AMD_AHEAD>(job, tile, rows.start, target),
            2 => one_row::<2, _MM_HINT_NTA, AMD_AHEAD>(job, tile, rows.start, target),
            _ => one_row::<1, _MM_HINT_NTA, AMD_AHEAD>(job, tile, rows.start, target),
        },
        (1, 3) => one_row::<3, _MM_HINT_T0, OTHER_AHEAD>(job, tile, rows.start, target),
        (1, 2) => one_row::<2, _MM_HINT_T0, OTHER_AHEAD>(job, tile, rows.start, target),
        (1, _) => one_row::<1, _MM_HINT_T0, OTHER_AHEAD>(job, tile, rows.start, target),
        (_, 3) => tile_pass::<3>(job, tile, rows, target),
        (_, 2) => tile_pass::<2>(job, tile, rows, target),
        _ => tile_pass::<1>(job, tile, rows, target),
    }
}

/// Panel rows per step of [`one_row`], each into its own accumulators.
const ONE_ROW_UNROLL: usize = 4;
/// How far ahead, in panel rows, [`one_row`] asks for the weight on AMD CPUs: as non-temporal.
///
/// A batch-1 step streams every weight once, ~2 GB for a Qwen2-0.5B-shaped model: with plain
/// loads the lines evicted from L2 fill L3 (a victim cache on AMD), pushing out what the Python
/// between two kernels runs on. That Python then runs from memory: in a batch-1 step its time
/// went from ~4 ms with the kernels stubbed out to ~11 ms between real kernels (and to ~25 ms
/// with the kernels stubbed by a 64 MB read each). The non-temporal hint asks the CPU not to
/// keep the lines once they leave L2. Steps alternating between variants in one process: 64,
/// 128 and 256 rows ahead were 4-7% faster than no prefetch (e.g. 83.3 against 88.1 ms), 32 and
/// 1024 2-3%, and the same prefetch as T0 5% slower. Batches (`tile_pass`) showed no change
/// with the hint there, so they keep theirs.
const AMD_AHEAD: usize = 128;
/// How far ahead, in panel rows (~4 KiB), [`one_row`] asks for the weight on other CPUs: into L1
/// like any load. On Intel the non-temporal hint fills L1 alone, and 24 KB ahead the lines were
/// gone again before use: a Xeon (AVX-512, 2 threads, 24 cold Qwen2-0.5B-sized weights) streamed
/// 8.0 GB/s with it against 22-24 GB/s with `T0` 21 rows ahead (22 at 128 rows, 22-23 as `T1`).
const OTHER_AHEAD: usize = 21;

/// One tile for the single row `row`: a matrix-vector product bound by reading the panel.
///
/// The chunked [`tile_pass`] would keep one row's three accumulators in `out` between chunks
/// and prefetch a line per panel row into L1; over a Qwen2-0.5B-shaped batch-1 step (fp32,
/// 2 threads, cold weights) it streamed ~12% slower than [`crate::gemv`] over the dense weight.
/// This loop, four panel rows per step into four sets of accumulators so no FMA waits on the
/// one before, streams about as fast as that GEMV or faster: over five runs, 25.3-40.9 against
/// 26.5-36.8 GB/s, within 6% either way where the machine read ~30 GB/s and 11-12% ahead in
/// the two runs where it read ~50.
#[inline(always)]
unsafe fn one_row<const V: usize, const HINT: i32, const AHEAD: usize>(
    job: &Job<'_>,
    tile: Tile,
    row: usize,
    target: Target,
) {
    let k_len = job.panels.in_features;
    let x = job.x.as_ptr().add(row * k_len);
    let mut acc = [[_mm512_setzero_ps(); V]; ONE_ROW_UNROLL];
    let fma = |acc: &mut [__m512; V], k: usize| {
        let (xk, w) = (_mm512_set1_ps(*x.add(k)), tile.weight.add(k * tile.stride));
        // Past the tile's end this reads into the next panel, the thread's next tile, or beyond
        // the weight: a prefetch is a hint and never faults.
        let ahead = w.wrapping_add(AHEAD * tile.stride).cast::<i8>();
        for v in 0..V {
            _mm_prefetch::<HINT>(ahead.wrapping_add(v * LINE));
        }
        for (v, lane) in acc.iter_mut().enumerate() {
            *lane = _mm512_fmadd_ps(xk, _mm512_loadu_ps(w.add(v * LANES)), *lane);
        }
    };
    let whole = k_len - k_len % ONE_ROW_UNROLL;
    for k in (0..whole).step_by(ONE_ROW_UNROLL) {
        for (u, acc) in acc.iter_mut().enumerate() {
            fma(acc, k + u);
        }
    }
    for k in whole..k_len {
        fma(&mut acc[0], k);
    }
    let at = target.row(row);
    let bias = job.bias.map(|b| b[tile.col..].as_ptr());
    let [a, b, c, d] = acc;
    for v in 0..V {
        let mut sum = _mm512_add_ps(_mm512_add_ps(a[v], b[v]), _mm512_add_ps(c[v], d[v]));
        let masked = v + 1 == V && tile.mask != !0;
        if let Some(bias) = bias {
            let b = bias.add(v * LANES);
            sum = _mm512_add_ps(
                sum,
                if masked { _mm512_maskz_loadu_ps(tile.mask, b) } else { _mm512_loadu_ps(b) },
            );
        }
        if masked {
            _mm512_mask_storeu_ps(at.add(v * LANES), tile.mask, sum);
        } else {
            _mm512_storeu_ps(at.add(v * LANES), sum);
        }
    }
}

/// One tile for the rows `rows`, chunk by chunk of panel rows.
#[inline(always)]
unsafe fn tile_pass<const V: usize>(job: &Job<'_>, tile: Tile, rows: Range<usize>, target: Target) {
    let k_len = job.panels.in_features;
    let blocks = rows.len().div_ceil(ROW_BLOCK);
    let lines = (K_CHUNK * tile.stride * std::mem::size_of::<f32>()).div_ceil(LINE);
    let per_block = lines.div_ceil(blocks);
    for k0 in (0..k_len).step_by(K_CHUNK) {
        let chunk = K_CHUNK.min(k_len - k0);
        let last = k0 + chunk == k_len;
        let ahead = if last { tile.next } else { tile.weight.wrapping_add((k0 + chunk) * tile.stride) };
        let bias = if last { job.bias.map(|b| b[tile.col..].as_ptr()) } else { None };
        for (i, r0) in rows.clone().step_by(ROW_BLOCK).enumerate() {
            let step = Step {
                x: job.x.as_ptr().add(r0 * k_len + k0),
                x_stride: k_len,
                weight: tile.weight.add(k0 * tile.stride),
                weight_stride: tile.stride,
                chunk,
                out: target.row(r0),
                out_stride: target.stride,
                mask: tile.mask,
                first: k0 == 0,
                bias,
                prefetch: ahead.cast::<i8>().wrapping_add(i * per_block * LINE),
                prefetch_lines: per_block.min(lines.saturating_sub(i * per_block)),
            };
            match (rows.end - r0).min(ROW_BLOCK) {
                8 => step.block::<8, V>(),
                7 => step.block::<7, V>(),
                6 => step.block::<6, V>(),
                5 => step.block::<5, V>(),
                4 => step.block::<4, V>(),
                3 => step.block::<3, V>(),
                2 => step.block::<2, V>(),
                _ => step.block::<1, V>(),
            }
        }
    }
}

/// One row block's share of one chunk.
struct Step {
    x: *const f32,
    x_stride: usize,
    weight: *const f32,
    weight_stride: usize,
    chunk: usize,
    out: *mut f32,
    out_stride: usize,
    mask: __mmask16,
    /// The chunk's accumulators start from zero rather than from `out`.
    first: bool,
    /// Added after the last chunk.
    bias: Option<*const f32>,
    prefetch: *const i8,
    prefetch_lines: usize,
}

impl Step {
    /// `out[R, V vectors] (+)= x[R, chunk] · weight[chunk, V vectors]`, the accumulators in
    /// registers. Inlined into the `avx512f` functions above, which lets its intrinsics inline.
    #[inline(always)]
    unsafe fn block<const R: usize, const V: usize>(&self) {
        let mut acc = [[_mm512_setzero_ps(); V]; R];
        if !self.first {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, lane) in row.iter_mut().enumerate() {
                    *lane = self.load(self.out.add(r * self.out_stride + v * LANES), v + 1 == V);
                }
            }
        }
        for k in 0..self.chunk {
            if k < self.prefetch_lines {
                _mm_prefetch::<_MM_HINT_T0>(self.prefetch.wrapping_add(k * LINE));
            }
            let w: [__m512; V] =
                std::array::from_fn(|v| _mm512_loadu_ps(self.weight.add(k * self.weight_stride + v * LANES)));
            for (r, row) in acc.iter_mut().enumerate() {
                let x = _mm512_set1_ps(*self.x.add(r * self.x_stride + k));
                for (lane, w) in row.iter_mut().zip(&w) {
                    *lane = _mm512_fmadd_ps(x, *w, *lane);
                }
            }
        }
        if let Some(bias) = self.bias {
            for v in 0..V {
                let b = self.load(bias.add(v * LANES), v + 1 == V);
                for row in acc.iter_mut() {
                    row[v] = _mm512_add_ps(row[v], b);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, lane) in row.iter().enumerate() {
                let at = self.out.add(r * self.out_stride + v * LANES);
                if v + 1 == V && self.mask != !0 {
                    _mm512_mask_storeu_ps(at, self.mask, *lane);
                } else {
                    _mm512_storeu_ps(at, *lane);
                }
            }
        }
    }

    /// A vector of `out` or of the bias; the last vector of a tile reads its real lanes only.
    #[inline(always)]
    unsafe fn load(&self, at: *const f32, last: bool) -> __m512 {
        if last && self.mask != !0 {
            _mm512_maskz_loadu_ps(self.mask, at)
        } else {
            _mm512_loadu_ps(at)
        }
    }
}
