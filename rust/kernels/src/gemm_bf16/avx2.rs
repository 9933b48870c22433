//! The bf16 GEMM in AVX2/FMA intrinsics: each 256-bit load of a panel row is eight columns ×
//! two `k`, widened in registers to the even-`k` vector (shift left by 16) and the odd-`k` one
//! (the low halves masked off), each multiplied into the accumulators with a broadcast `x`.
//!
//! From three rows on, a block is 6 rows × 16 columns: 12 accumulators, two weight vectors and
//! the broadcast fill the 16 registers. One or two rows take a whole panel (up to 6 vectors) per
//! pass, so the weight is read as one contiguous stream, as a decode step's GEMV must.

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Job, Tile};
use crate::gemm::PANEL_WIDTH;
use crate::Element;

const LANES: usize = 8;
/// Rows per block from three rows on.
const ROWS: usize = 6;
/// Columns per tile from three rows on: two vectors.
const COLS: usize = 16;

/// # Safety
/// As [`Job::run`]; the CPU has AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn run<T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    let x_stride = 2 * job.panels.pairs;
    if job.rows <= 2 {
        for tile in job.tiles(cols, PANEL_WIDTH) {
            match job.rows {
                1 => by_vectors::<1, T>(job, tile, 0),
                _ => by_vectors::<2, T>(job, tile, 0),
            }
        }
        return;
    }
    for slab in job.slabs(x_stride * 4, ROWS) {
        for tile in job.tiles(cols.clone(), COLS) {
            for r0 in slab.clone().step_by(ROWS) {
                match (slab.end - r0).min(ROWS) {
                    6 => by_vectors::<6, T>(job, tile, r0),
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
        2 => block::<R, 2, T>(job, tile, r0),
        3 => block::<R, 3, T>(job, tile, r0),
        4 => block::<R, 4, T>(job, tile, r0),
        5 => block::<R, 5, T>(job, tile, r0),
        _ => block::<R, 6, T>(job, tile, r0),
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
    let mut sums = [0.0f32; PANEL_WIDTH];
    for (r, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(sums.as_mut_ptr().add(v * LANES), *a);
        }
        job.sink.write(r0 + r, tile.col, &sums[..tile.span]);
    }
}
