//! The bf16 GEMM in AVX2/FMA intrinsics: each 256-bit load of a panel row is eight columns ×
//! two `k`, widened in registers to the even-`k` vector (shift left by 16) and the odd-`k` one
//! (the low halves masked off), each multiplied into the accumulators with a broadcast `x`.
//!
//! From three rows on, a block is 5 rows × 16 columns ([`block`]): 10 accumulators, the two loaded
//! vectors, the two widened ones and the broadcast fill 15 of the 16 registers (6 rows spilled
//! accumulators to the stack every panel row). One row takes a whole panel per pass and two rows
//! half a panel ([`stream`]), each loaded vector widened and used at once with the rows' `x`
//! broadcast once per panel row, so the weight is read as a contiguous stream, as a decode
//! step's GEMV must, with nothing spilled.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Job, Tile};
use crate::gemm::PANEL_WIDTH;
use crate::Element;

const LANES: usize = 8;
/// Rows per block from three rows on.
const ROWS: usize = 5;
/// Columns per tile from three rows on: two vectors.
const COLS: usize = 16;

/// # Safety
/// As [`Job::run`]; the CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn run<T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    let x_stride = 2 * job.panels.pairs;
    if job.rows <= 2 {
        let two = job.rows == 2;
        for tile in job.tiles(cols, if two { PANEL_WIDTH / 2 } else { PANEL_WIDTH }) {
            match (two, tile.span.div_ceil(LANES)) {
                (true, 1) => stream::<2, 1, T>(job, tile),
                (true, 2) => stream::<2, 2, T>(job, tile),
                (true, _) => stream::<2, 3, T>(job, tile),
                (false, 1) => stream::<1, 1, T>(job, tile),
                (false, 2) => stream::<1, 2, T>(job, tile),
                (false, 3) => stream::<1, 3, T>(job, tile),
                (false, 4) => stream::<1, 4, T>(job, tile),
                (false, 5) => stream::<1, 5, T>(job, tile),
                (false, _) => stream::<1, 6, T>(job, tile),
            }
        }
        return;
    }
    for slab in job.slabs(x_stride * 4, ROWS) {
        for tile in job.tiles(cols.clone(), COLS) {
            for r0 in slab.clone().step_by(ROWS) {
                match (slab.end - r0).min(ROWS) {
                    5 => by_vectors::<5, T>(job, tile, r0),
                    4 => by_vectors::<4, T>(job, tile, r0),
                    3 => by_vectors::<3, T>(job, tile, r0),
                    2 => by_vectors::<2, T>(job, tile, r0),
                    _ => by_vectors::<1, T>(job, tile, r0),
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn by_vectors<const R: usize, T: Element>(job: &Job<'_, T>, tile: Tile, r0: usize) {
    match tile.span.div_ceil(LANES) {
        1 => block::<R, 1, T>(job, tile, r0),
        _ => block::<R, 2, T>(job, tile, r0),
    }
}

/// [`block`] for the one or two rows of a decode step: each vector of the panel row is loaded,
/// widened and multiplied at once, the rows' even and odd `x` broadcast once per panel row.
#[inline(always)]
unsafe fn stream<const R: usize, const V: usize, T: Element>(job: &Job<'_, T>, tile: Tile) {
    let x_stride = 2 * job.panels.pairs;
    let x = job.x.as_ptr();
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    for p in 0..job.panels.pairs {
        let w = tile.words.add(p * tile.stride);
        let xe: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*x.add(r * x_stride + 2 * p)));
        let xo: [__m256; R] = std::array::from_fn(|r| _mm256_set1_ps(*x.add(r * x_stride + 2 * p + 1)));
        for v in 0..V {
            let raw = _mm256_loadu_si256(w.add(v * LANES).cast());
            let even = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw));
            let odd = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
            for (r, acc) in acc.iter_mut().enumerate() {
                acc[v] = _mm256_fmadd_ps(xo[r], odd, _mm256_fmadd_ps(xe[r], even, acc[v]));
            }
        }
    }
    store(job, tile, 0, &acc);
}

/// The block's sums, plus bias, to `out`'s rows `r0..` and the tile's columns.
#[inline(always)]
unsafe fn store<const R: usize, const V: usize, T: Element>(
    job: &Job<'_, T>,
    tile: Tile,
    r0: usize,
    acc: &[[__m256; V]; R],
) {
    let mut sums = [0.0f32; PANEL_WIDTH];
    for (r, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(sums.as_mut_ptr().add(v * LANES), *a);
        }
        job.sink.write(r0 + r, tile.col, &sums[..tile.span]);
    }
}

/// Rows `r0..r0 + R` × the tile's columns (`V` vectors, the last maybe part padding), over every
/// panel row; the sums go to `out` once.
#[inline(always)]
unsafe fn block<const R: usize, const V: usize, T: Element>(job: &Job<'_, T>, tile: Tile, r0: usize) {
    let x_stride = 2 * job.panels.pairs;
    let x = job.x.as_ptr().add(r0 * x_stride);
    let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); V]; R];
    for p in 0..job.panels.pairs {
        let w = tile.words.add(p * tile.stride);
        // Padding columns are zero in the panel, so whole vectors are always there to load.
        let raw: [__m256i; V] = std::array::from_fn(|v| _mm256_loadu_si256(w.add(v * LANES).cast()));
        let even: [__m256; V] = std::array::from_fn(|v| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(raw[v])));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xe = _mm256_set1_ps(*x.add(r * x_stride + 2 * p));
            for (a, w) in acc.iter_mut().zip(&even) {
                *a = _mm256_fmadd_ps(xe, *w, *a);
            }
        }
        let odd: [__m256; V] = std::array::from_fn(|v| _mm256_castsi256_ps(_mm256_and_si256(raw[v], high)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xo = _mm256_set1_ps(*x.add(r * x_stride + 2 * p + 1));
            for (a, w) in acc.iter_mut().zip(&odd) {
                *a = _mm256_fmadd_ps(xo, *w, *a);
            }
        }
    }
    store(job, tile, r0, &acc);
}
