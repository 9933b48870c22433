//! The many-row half of the quantized linear layers: `out = x · wᵀ + bias` for a batch of rows,
//! from a weight that stays quantized and is decoded a tile at a time.
//!
//! A thread takes runs of [`TILE_ROWS`] output features. For each run and each K-block of up to
//! [`K_BLOCK`] columns, the format's [`Tiles::decode`] writes that tile as f32 into a buffer
//! (12 × 256 × 4 B = 12 KB, which stays in L1), and a micro-kernel multiplies it with every row
//! of `x`: 4 rows of `x` against 3 rows of the tile, 12 vector accumulators of dot-product
//! partial sums. Between K-blocks the accumulators wait in a per-run buffer (`rows × 12`
//! vectors, 48 KB at 128 rows: L2), and their lanes are summed once, at the end. So each weight
//! element is decoded once per call, whatever the batch, and the weight is never held whole in
//! f32; decoding is one pass per element against `rows` multiply-adds, so from ~8 rows on the
//! multiply-adds dominate and the kernel runs at the speed of an f32 GEMM.
//!
//! Invariants: `x` is `[rows, k_padded]` with zeros in the columns past `in_features`, and
//! `k_padded` is a multiple of [`K_STEP`]; decoders write only finite values (zeros past
//! `in_features`), so the padding adds nothing.

use std::ops::Range;

use crate::{openmp, simd};

/// Output features decoded together: four passes of the 3-row micro-kernel.
pub(crate) const TILE_ROWS: usize = 12;
/// Columns per decoded tile.
pub(crate) const K_BLOCK: usize = 256;
/// What every K-block length is a multiple of: an int4 block, two AVX-512 vectors.
pub(crate) const K_STEP: usize = 32;
/// Rows of `x` and of the tile per micro-kernel call: 12 accumulators, with the three tile
/// vectors and one `x` vector, fill AVX2's 16 registers.
const MR: usize = 4;
const NR: usize = 3;
/// Lanes of one partial sum: an AVX-512 vector (AVX2 uses the first eight).
const LANES: usize = 16;

type Partial = [f32; LANES];

/// A weight that decodes a tile at a time.
pub(crate) trait Tiles: Sync {
    /// Writes weight rows `rows`, columns `k0..k0 + len`, as f32 into `dst`: the run's row `i`
    /// at `dst[i * len..(i + 1) * len]`. `k0` and `len` are multiples of [`K_STEP`]; columns at
    /// or past `in_features` must be written as zeros.
    fn decode(&self, rows: Range<usize>, k0: usize, len: usize, dst: &mut [f32]);
}

/// `x` is `[rows, k_padded]`, `out` `[rows, out_features]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TiledShape {
    pub rows: usize,
    pub out_features: usize,
    pub k_padded: usize,
}

/// `out[r, n] = Σ_k x[r, k] · w[n, k] + bias[n]` on up to `threads` threads of the OpenMP team.
/// The caller has checked every length against `shape`.
pub(crate) fn tiled_linear<W: Tiles>(
    x: &[f32],
    weight: &W,
    bias: Option<&[f32]>,
    out: &mut [f32],
    shape: TiledShape,
    threads: usize,
) {
    let runs = shape.out_features.div_ceil(TILE_ROWS);
    if runs == 0 || shape.rows == 0 {
        return;
    }
    let dst = openmp::SharedMut(out.as_mut_ptr());
    openmp::parallel(threads.min(runs), |thread, team| {
        let mut scratch = Scratch::new(shape);
        for run in openmp::share(runs, thread, team) {
            let features = run * TILE_ROWS..((run + 1) * TILE_ROWS).min(shape.out_features);
            // SAFETY: each thread writes only its runs' columns of `out`, which holds
            // `rows * out_features` elements and outlives `parallel`.
            unsafe { scratch.run(x, weight, bias, features, dst.get()) };
        }
    });
}

/// One thread's buffers: the decoded tile and the run's partial sums.
struct Scratch {
    shape: TiledShape,
    tile: Vec<f32>,
    partial: Vec<Partial>,
}

impl Scratch {
    fn new(shape: TiledShape) -> Self {
        let tile = vec![0.0; TILE_ROWS * K_BLOCK.min(shape.k_padded)];
        Scratch { shape, tile, partial: vec![[0.0; LANES]; shape.rows * TILE_ROWS] }
    }

    /// # Safety
    /// `out` addresses `rows * out_features` elements, of which no other thread writes the
    /// columns `features`.
    unsafe fn run<W: Tiles>(
        &mut self,
        x: &[f32],
        weight: &W,
        bias: Option<&[f32]>,
        features: Range<usize>,
        out: *mut f32,
    ) {
        let TiledShape { rows, out_features, k_padded } = self.shape;
        self.partial.fill([0.0; LANES]);
        for k0 in (0..k_padded).step_by(K_BLOCK) {
            let len = K_BLOCK.min(k_padded - k0);
            let tile = &mut self.tile[..features.len() * len];
            weight.decode(features.clone(), k0, len, tile);
            let block = Block { x: x.as_ptr().add(k0), x_stride: k_padded, tile: tile.as_ptr(), len };
            multiply(block, rows, features.len(), &mut self.partial);
        }
        for r in 0..rows {
            for (i, n) in features.clone().enumerate() {
                let sum = reduce(&self.partial[r * TILE_ROWS + i]);
                *out.add(r * out_features + n) = sum + bias.map_or(0.0, |b| b[n]);
            }
        }
    }
}

/// Sum of the lanes, pairwise.
fn reduce(p: &Partial) -> f32 {
    let mut acc = *p;
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

/// One K-block's operands: `x`'s rows from the block's first column (`x_stride` apart), the
/// decoded tile (rows `len` apart).
#[derive(Clone, Copy)]
struct Block {
    x: *const f32,
    x_stride: usize,
    tile: *const f32,
    len: usize,
}

/// Adds one K-block's products into `partial` (`rows × TILE_ROWS`), `cols` tile rows.
unsafe fn multiply(block: Block, rows: usize, cols: usize, partial: &mut [Partial]) {
    #[cfg(target_arch = "x86_64")]
    {
        if simd::has_avx512f() {
            return for_each_micro(block, rows, cols, partial, x86::micro_avx512_dispatch);
        }
        if simd::has_avx2_fma() {
            return for_each_micro(block, rows, cols, partial, x86::micro_avx2_dispatch);
        }
    }
    for_each_micro(block, rows, cols, partial, micro_portable_dispatch);
}

/// `micro(block at (r0, c0), m, n, accumulators)` over every `MR × NR` piece (smaller at the edges).
unsafe fn for_each_micro(
    block: Block,
    rows: usize,
    cols: usize,
    partial: &mut [Partial],
    micro: unsafe fn(Block, usize, usize, *mut Partial),
) {
    for r0 in (0..rows).step_by(MR) {
        for c0 in (0..cols).step_by(NR) {
            let piece =
                Block { x: block.x.add(r0 * block.x_stride), tile: block.tile.add(c0 * block.len), ..block };
            let acc = partial.as_mut_ptr().add(r0 * TILE_ROWS + c0);
            micro(piece, MR.min(rows - r0), NR.min(cols - c0), acc);
        }
    }
}

/// Calls `$f::<M, N>` for the runtime `(m, n)`, `1 <= m <= 4`, `1 <= n <= 3`.
macro_rules! by_size {
    ($f:ident, $m:expr, $n:expr, $($arg:expr),*) => {
        match ($m, $n) {
            (4, 3) => $f::<4, 3>($($arg),*),
            (4, 2) => $f::<4, 2>($($arg),*),
            (4, _) => $f::<4, 1>($($arg),*),
            (3, 3) => $f::<3, 3>($($arg),*),
            (3, 2) => $f::<3, 2>($($arg),*),
            (3, _) => $f::<3, 1>($($arg),*),
            (2, 3) => $f::<2, 3>($($arg),*),
            (2, 2) => $f::<2, 2>($($arg),*),
            (2, _) => $f::<2, 1>($($arg),*),
            (_, 3) => $f::<1, 3>($($arg),*),
            (_, 2) => $f::<1, 2>($($arg),*),
            (_, _) => $f::<1, 1>($($arg),*),
        }
    };
}

unsafe fn micro_portable_dispatch(block: Block, m: usize, n: usize, acc: *mut Partial) {
    by_size!(micro_portable, m, n, block, acc)
}

/// The reference loop: lane `k % 8` of each accumulator takes column `k`.
unsafe fn micro_portable<const M: usize, const N: usize>(block: Block, acc: *mut Partial) {
    for i in 0..M {
        for j in 0..N {
            let sums = &mut *acc.add(i * TILE_ROWS + j);
            let x = std::slice::from_raw_parts(block.x.add(i * block.x_stride), block.len);
            let w = std::slice::from_raw_parts(block.tile.add(j * block.len), block.len);
            for (k, (a, b)) in x.iter().zip(w).enumerate() {
                sums[k % 8] += a * b;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Block, Partial, TILE_ROWS};

    pub(super) unsafe fn micro_avx2_dispatch(block: Block, m: usize, n: usize, acc: *mut Partial) {
        by_size!(micro_avx2, m, n, block, acc)
    }

    pub(super) unsafe fn micro_avx512_dispatch(block: Block, m: usize, n: usize, acc: *mut Partial) {
        by_size!(micro_avx512, m, n, block, acc)
    }

    /// `M × N` dot products over the block, eight columns per step, each pair in its own
    /// accumulator (lanes 0-7 of its partial sum).
    #[target_feature(enable = "avx2,fma")]
    unsafe fn micro_avx2<const M: usize, const N: usize>(block: Block, acc: *mut Partial) {
        let mut a = [[_mm256_setzero_ps(); N]; M];
        for (i, row) in a.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm256_loadu_ps((*acc.add(i * TILE_ROWS + j)).as_ptr());
            }
        }
        let mut w = [_mm256_setzero_ps(); N];
        for k in (0..block.len).step_by(8) {
            for (j, v) in w.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(block.tile.add(j * block.len + k));
            }
            for (i, row) in a.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(block.x.add(i * block.x_stride + k));
                for (v, w) in row.iter_mut().zip(&w) {
                    *v = _mm256_fmadd_ps(x, *w, *v);
                }
            }
        }
        for (i, row) in a.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                _mm256_storeu_ps((*acc.add(i * TILE_ROWS + j)).as_mut_ptr(), *v);
            }
        }
    }

    /// [`micro_avx2`] sixteen columns per step.
    #[target_feature(enable = "avx512f")]
    unsafe fn micro_avx512<const M: usize, const N: usize>(block: Block, acc: *mut Partial) {
        let mut a = [[_mm512_setzero_ps(); N]; M];
        for (i, row) in a.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = _mm512_loadu_ps((*acc.add(i * TILE_ROWS + j)).as_ptr());
            }
        }
        let mut w = [_mm512_setzero_ps(); N];
        for k in (0..block.len).step_by(16) {
            for (j, v) in w.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(block.tile.add(j * block.len + k));
            }
            for (i, row) in a.iter_mut().enumerate() {
                let x = _mm512_loadu_ps(block.x.add(i * block.x_stride + k));
                for (v, w) in row.iter_mut().zip(&w) {
                    *v = _mm512_fmadd_ps(x, *w, *v);
                }
            }
        }
        for (i, row) in a.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                _mm512_storeu_ps((*acc.add(i * TILE_ROWS + j)).as_mut_ptr(), *v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{linear, values};

    /// A plain f32 weight, zero-padded to `k_padded` columns.
    struct Plain {
        w: Vec<f32>,
        k: usize,
    }

    impl Tiles for Plain {
        fn decode(&self, rows: Range<usize>, k0: usize, len: usize, dst: &mut [f32]) {
            for (i, n) in rows.enumerate() {
                for c in 0..len {
                    let k = k0 + c;
                    dst[i * len + c] = if k < self.k { self.w[n * self.k + k] } else { 0.0 };
                }
            }
        }
    }

    fn padded(x: &[f32], rows: usize, k: usize, k_padded: usize) -> Vec<f32> {
        let mut out = vec![0.0; rows * k_padded];
        for r in 0..rows {
            out[r * k_padded..r * k_padded + k].copy_from_slice(&x[r * k..(r + 1) * k]);
        }
        out
    }

    #[test]
    fn every_path_matches_the_reference_at_odd_sizes() {
        // Rows around the 4-row micro-kernel, features around the 3-row piece and 12-row run, k
        // across the 256-column block.
        for (rows, n, k) in [(3, 7, 37usize), (7, 13, 300), (33, 25, 64), (1, 12, 520), (5, 1, 5)] {
            let k_padded = k.div_ceil(K_STEP) * K_STEP;
            let (x, w, b) = (values(rows * k, 1), values(n * k, 2), values(n, 3));
            let xp = padded(&x, rows, k, k_padded);
            let want = linear(&x, &w, Some(&b), rows, n, k);
            let shape = TiledShape { rows, out_features: n, k_padded };
            let mut out = vec![f32::NAN; rows * n];
            tiled_linear(&xp, &Plain { w: w.clone(), k }, Some(&b), &mut out, shape, 2);
            crate::test_support::assert_near(&out, &want, &format!("{rows}x{n}x{k}"));
            // The portable loop on its own, one K-block.
            let mut partial = vec![[0.0; LANES]; rows * TILE_ROWS];
            let cols = n.min(TILE_ROWS);
            let len = k_padded.min(K_BLOCK);
            let mut tile = vec![0.0; cols * len];
            Plain { w: w.clone(), k }.decode(0..cols, 0, len, &mut tile);
            let block = Block { x: xp.as_ptr(), x_stride: k_padded, tile: tile.as_ptr(), len };
            // SAFETY: the buffers hold the rows and columns the block names.
            unsafe { for_each_micro(block, rows, cols, &mut partial, micro_portable_dispatch) };
            let mut vector = vec![[0.0; LANES]; rows * TILE_ROWS];
            // SAFETY: as above.
            unsafe { multiply(block, rows, cols, &mut vector) };
            let sums = |p: &[Partial]| p.iter().map(reduce).collect::<Vec<_>>();
            crate::test_support::assert_near(&sums(&vector), &sums(&partial), "portable");
        }
    }
}
