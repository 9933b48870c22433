//! The bf16 GEMM in AVX-512 intrinsics, blocks of 8 rows × a whole panel (up to 3 vectors of 16
//! columns: 24 accumulators). Two ways to multiply a panel row (16 columns × two `k` per 512-bit
//! load) into them:
//! - [`run`] (AVX-512F): widen it in registers to the even-`k` vector (shift left by 16) and the
//!   odd-`k` one (low halves masked off), each multiplied with a broadcast f32 `x`;
//! - [`run_dot`] (AVX512-BF16): `vdpbf16ps` with the broadcast bf16 pair of `x`, both products
//!   in one instruction.
//!
//! The unit tests run each where the CPU has its instructions (`run_dot` first ran on an
//! AMX-capable Xeon lent with a GPU: `benches/gpu_run.sh cpu`).

use std::arch::x86_64::*;
use std::ops::Range;

use super::{Job, Tile};
use crate::gemm::PANEL_WIDTH;
use crate::simd::{prefetch_stream, STREAM_AHEAD};
use crate::Element;

const LANES: usize = 16;
const ROWS: usize = 8;

/// How one panel row multiplies into a block's accumulators.
trait PanelRow {
    /// `acc[r][v] += Σ over the pair p of x[r] · w[v]`, for the block's `R` rows.
    unsafe fn fma<const R: usize, const V: usize, T: Element>(
        job: &Job<'_, T>,
        r0: usize,
        w: *const u32,
        p: usize,
        acc: &mut [[__m512; V]; R],
    );
    /// Bytes of one row of the prepared `x`.
    fn x_row_bytes<T: Element>(job: &Job<'_, T>) -> usize;
}

struct Widen;
struct Dot;

impl PanelRow for Widen {
    #[inline(always)]
    unsafe fn fma<const R: usize, const V: usize, T: Element>(
        job: &Job<'_, T>,
        r0: usize,
        w: *const u32,
        p: usize,
        acc: &mut [[__m512; V]; R],
    ) {
        let stride = 2 * job.panels.pairs;
        let x = job.x.as_ptr().add(r0 * stride + 2 * p);
        let raw: [__m512i; V] = std::array::from_fn(|v| _mm512_loadu_si512(w.add(v * LANES).cast()));
        let even: [__m512; V] = std::array::from_fn(|v| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(raw[v])));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xe = _mm512_set1_ps(*x.add(r * stride));
            for (a, w) in acc.iter_mut().zip(&even) {
                *a = _mm512_fmadd_ps(xe, *w, *a);
            }
        }
        let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
        let odd: [__m512; V] = std::array::from_fn(|v| _mm512_castsi512_ps(_mm512_and_si512(raw[v], high)));
        for (r, acc) in acc.iter_mut().enumerate() {
            let xo = _mm512_set1_ps(*x.add(r * stride + 1));
            for (a, w) in acc.iter_mut().zip(&odd) {
                *a = _mm512_fmadd_ps(xo, *w, *a);
            }
        }
    }

    fn x_row_bytes<T: Element>(job: &Job<'_, T>) -> usize {
        8 * job.panels.pairs
    }
}

impl PanelRow for Dot {
    #[inline(always)]
    unsafe fn fma<const R: usize, const V: usize, T: Element>(
        job: &Job<'_, T>,
        r0: usize,
        w: *const u32,
        p: usize,
        acc: &mut [[__m512; V]; R],
    ) {
        let stride = job.panels.pairs;
        let x = job.x_pairs.as_ptr().add(r0 * stride + p);
        let ws: [__m512bh; V] = std::array::from_fn(|v| {
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(w.add(v * LANES).cast()))
        });
        for (r, acc) in acc.iter_mut().enumerate() {
            let pair = std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*x.add(r * stride) as i32));
            for (a, w) in acc.iter_mut().zip(&ws) {
                *a = _mm512_dpbf16_ps(*a, *w, pair);
            }
        }
    }

    fn x_row_bytes<T: Element>(job: &Job<'_, T>) -> usize {
        4 * job.panels.pairs
    }
}

/// # Safety
/// As [`Job::run`]; the CPU has AVX-512F.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(super) unsafe fn run<T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    run_with::<Widen, T>(job, cols);
}

/// # Safety
/// As [`Job::run`]; the CPU has AVX-512F and AVX512-BF16.
#[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
pub(super) unsafe fn run_dot<T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    run_with::<Dot, T>(job, cols);
}

#[inline(always)]
unsafe fn run_with<M: PanelRow, T: Element>(job: &Job<'_, T>, cols: Range<usize>) {
    for slab in job.slabs(M::x_row_bytes(job), ROWS) {
        for tile in job.tiles(cols.clone(), PANEL_WIDTH) {
            by_rows::<M, T>(job, tile, slab.clone());
        }
    }
}

/// The `vdpbf16ps` loop over `rows` of one tile: the rows the AMX path leaves over.
///
/// # Safety
/// As [`run_dot`], inlined into a function that enables its instructions.
#[inline(always)]
pub(super) unsafe fn dot_rows<T: Element>(job: &Job<'_, T>, tile: Tile, rows: Range<usize>) {
    by_rows::<Dot, T>(job, tile, rows);
}

#[inline(always)]
unsafe fn by_rows<M: PanelRow, T: Element>(job: &Job<'_, T>, tile: Tile, rows: Range<usize>) {
    for r0 in rows.clone().step_by(ROWS) {
        match (rows.end - r0).min(ROWS) {
            8 => by_vectors::<M, 8, T>(job, tile, r0),
            7 => by_vectors::<M, 7, T>(job, tile, r0),
            6 => by_vectors::<M, 6, T>(job, tile, r0),
            5 => by_vectors::<M, 5, T>(job, tile, r0),
            4 => by_vectors::<M, 4, T>(job, tile, r0),
            3 => by_vectors::<M, 3, T>(job, tile, r0),
            2 => by_vectors::<M, 2, T>(job, tile, r0),
            _ => by_vectors::<M, 1, T>(job, tile, r0),
        }
    }
}

/// Adds panel rows `pairs` of the tile's first `vectors` × 16 columns, times rows
/// `r0..r0 + sums.len()` of `x`, to `sums`: the `k` that the AMX path's whole steps of 32 leave
/// over.
///
/// # Safety
/// As [`run_dot`], inlined into a function that enables its instructions; `N ≥ 16 · vectors`.
#[inline(always)]
pub(super) unsafe fn dot_tail<const N: usize, T: Element>(
    job: &Job<'_, T>,
    tile: Tile,
    r0: usize,
    vectors: usize,
    pairs: Range<usize>,
    sums: &mut [[f32; N]],
) {
    if pairs.is_empty() {
        return;
    }
    let x = job.x_pairs.as_ptr().add(r0 * job.panels.pairs);
    for (r, row) in sums.iter_mut().enumerate() {
        for v in 0..vectors {
            let mut acc = _mm512_loadu_ps(row.as_ptr().add(v * LANES));
            for p in pairs.clone() {
                let w = _mm512_loadu_si512(tile.words.add(p * tile.stride + v * LANES).cast());
                let pair = _mm512_set1_epi32(*x.add(r * job.panels.pairs + p) as i32);
                acc = _mm512_dpbf16_ps(
                    acc,
                    std::mem::transmute::<__m512i, __m512bh>(w),
                    std::mem::transmute::<__m512i, __m512bh>(pair),
                );
            }
            _mm512_storeu_ps(row.as_mut_ptr().add(v * LANES), acc);
        }
    }
}

#[inline(always)]
unsafe fn by_vectors<M: PanelRow, const R: usize, T: Element>(job: &Job<'_, T>, tile: Tile, r0: usize) {
    match tile.span.div_ceil(LANES) {
        1 => block::<M, R, 1, T>(job, tile, r0),
        2 => block::<M, R, 2, T>(job, tile, r0),
        _ => block::<M, R, 3, T>(job, tile, r0),
    }
}

/// Rows `r0..r0 + R` × the tile's `V` vectors over every panel row; the sums go to `out` once.
#[inline(always)]
unsafe fn block<M: PanelRow, const R: usize, const V: usize, T: Element>(
    job: &Job<'_, T>,
    tile: Tile,
    r0: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for p in 0..job.panels.pairs {
        let w = tile.words.add(p * tile.stride);
        if R <= 2 {
            // One or two rows (decode) stream the panel from memory once; more reuse it from L2.
            prefetch_stream(w.cast::<u8>().wrapping_add(STREAM_AHEAD), V * 64);
        }
        M::fma::<R, V, T>(job, r0, w, p, &mut acc);
    }
    let mut sums = [0.0f32; PANEL_WIDTH];
    for (r, acc) in acc.iter().enumerate() {
        for (v, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(sums.as_mut_ptr().add(v * LANES), *a);
        }
        job.sink.write(r0 + r, tile.col, &sums[..tile.span]);
    }
}
