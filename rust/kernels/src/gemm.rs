//! `out = x · weightᵀ + bias` in f32, from a weight packed once into column panels: the linear
//! layers of decode steps, batch 1 included, and of prefill slabs.
//!
//! The weight `[out_features, in_features]` is stored as panels of [`PANEL_WIDTH`] output
//! columns, each panel `[in_features, width]` row-major, so one panel row is three 16-lane
//! vectors read side by side. The AVX-512 micro-kernel (module `avx512`) keeps 8 rows × 48
//! columns of `out` in 24 registers, broadcasting one `x` element per row against each panel
//! row, over chunks of 128 panel rows (24 KB, which stay in L1 while every 8-row block of `x`
//! passes over them). While the first row block reads a chunk from memory, the row blocks
//! prefetch the next one.
//!
//! Why not oneDNN: on the 2-core AVX-512 development machine (Zen 4, fp32, 2 threads, weights
//! cold as in a real step: 24 layers' worth cycled), a Qwen2-0.5B 32-row decode step's layer
//! matmuls take 116-150 ms here against 140-169 ms through oneDNN's packed `_linear_pointwise`,
//! and its 151936-column LM head 40-45 ms against 47-54; from 3 to 256 rows this kernel was
//! 7-45% faster at every size measured (`benches/cpu_gemm.py` compares the two; this VM's
//! figures move 10-30% between runs).
//!
//! bf16 weights have their own GEMM, on the same column panels: [`crate::gemm_bf16`].

use std::ops::Range;

use crate::activation::silu_mul;
use crate::error::{check_len, KernelError};
use crate::openmp;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod pack;

pub use pack::{pack_weight, pack_weight_rows, packed_len, RowBlock};

/// Output columns per panel of the packed weight.
pub const PANEL_WIDTH: usize = 48;
/// Columns per vector; panels narrower than [`PANEL_WIDTH`] (the last) are padded to a multiple.
const LANES: usize = 16;

/// `x` is `[rows, in_features]` and `out` is `[rows, out_features]`, row-major; the weight is
/// `[out_features, in_features]` before packing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmShape {
    pub rows: usize,
    pub out_features: usize,
    pub in_features: usize,
}

/// Where the panels of a packed weight sit.
#[derive(Clone, Copy, Debug)]
struct Panels {
    out_features: usize,
    in_features: usize,
    /// `out_features` rounded up to whole vectors: the packed columns.
    padded: usize,
}

impl Panels {
    fn new(out_features: usize, in_features: usize) -> Self {
        Self { out_features, in_features, padded: out_features.div_ceil(LANES) * LANES }
    }

    fn len(&self) -> usize {
        self.padded * self.in_features
    }

    /// Columns of panel `panel`: [`PANEL_WIDTH`] but for the last.
    fn width(&self, panel: usize) -> usize {
        (self.padded - panel * PANEL_WIDTH).min(PANEL_WIDTH)
    }

    /// Index of panel `panel`'s first element; every panel before it is full width.
    fn offset(&self, panel: usize) -> usize {
        panel * PANEL_WIDTH * self.in_features
    }

    /// Index of `weight[col, k]` in the packed layout.
    fn index(&self, col: usize, k: usize) -> usize {
        let panel = col / PANEL_WIDTH;
        self.offset(panel) + k * self.width(panel) + col % PANEL_WIDTH
    }
}

/// Whether [`gemm`] runs vectorized on this CPU (AVX-512F); elsewhere it takes a plain loop,
/// correct but many times slower than a BLAS.
pub fn vectorized() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r, n] = Σ_k x[r, k] · weight[n, k] + bias[n]`, `packed` being [`pack_weight`]'s form of
/// `weight`. Threads of the OpenMP team take contiguous ranges of 16 output columns.
pub fn gemm(
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    shape: GemmShape,
    threads: usize,
) -> Result<(), KernelError> {
    let panels = check_buffers(x, packed, bias, out.len(), shape, 1)?;
    let job = Job { x, packed, bias, panels };
    // SAFETY: each tile of `out`, whose length was checked, goes to one thread.
    for_each_tile(panels, shape.rows, out, threads, |tiles, thread, out| unsafe {
        job.run(tiles, thread, out)
    });
    Ok(())
}

/// `out[r, n] = silu(gate[r, n]) · up[r, n]` for a gated MLP's `[gate, up]` projection, where
/// `gate = x · w_gateᵀ + b_gate` and `up` likewise: [`gemm`] and SiLU-and-mul in one pass, so
/// the `[rows, 2 · width]` product is never written out and read back. `shape.out_features` is
/// `width`; `packed` is `w_gate` then `w_up`, each in [`pack_weight`]'s form ([`packed_len`]
/// elements); `bias`, when given, is `[b_gate, b_up]`. Each product's values are bit for bit
/// [`gemm`]'s, and the activation is `activation::silu_and_mul`'s.
pub fn gemm_silu_mul(
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    shape: GemmShape,
    threads: usize,
) -> Result<(), KernelError> {
    let panels = check_buffers(x, packed, bias, out.len(), shape, 2)?;
    let (gate_w, up_w) = packed.split_at(panels.len());
    let (gate_b, up_b) = match bias.map(|b| b.split_at(shape.out_features)) {
        Some((g, u)) => (Some(g), Some(u)),
        None => (None, None),
    };
    let gate = Job { x, packed: gate_w, bias: gate_b, panels };
    let up = Job { packed: up_w, bias: up_b, ..gate };
    // SAFETY: each tile of `out`, whose length was checked, goes to one thread.
    for_each_tile(panels, shape.rows, out, threads, |tiles, thread, out| unsafe {
        run_gated(&gate, &up, tiles, thread, out)
    });
    Ok(())
}

/// Checks one call's buffers against `shape`, for `parts` weights of `shape`'s size packed one
/// after another (and as many biases); returns the panels of one weight.
fn check_buffers(
    x: &[f32],
    packed: &[f32],
    bias: Option<&[f32]>,
    out_len: usize,
    shape: GemmShape,
    parts: usize,
) -> Result<Panels, KernelError> {
    let GemmShape { rows, out_features, in_features } = shape;
    let panels = Panels::new(out_features, in_features);
    check_len("x", x.len(), rows * in_features)?;
    check_len("packed", packed.len(), parts * panels.len())?;
    check_len("out", out_len, rows * out_features)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), parts * out_features)?;
    }
    Ok(panels)
}

/// Runs `work(tiles, thread, out)` on each thread of the OpenMP team, which takes tiles from
/// `tiles` until none is left; nothing when `out` is empty.
fn for_each_tile(
    panels: Panels,
    rows: usize,
    out: &mut [f32],
    threads: usize,
    work: impl Fn(&Tiles, usize, *mut f32) + Sync,
) {
    if out.is_empty() {
        return;
    }
    let tiles = Tiles::new(panels, rows, threads);
    let dst = openmp::SharedMut(out.as_mut_ptr());
    openmp::parallel(tiles.team, |thread, _| work(&tiles, thread, dst.get()));
}

/// Rows per pass over the weight: a slab's accumulators for one panel (256 × 48 × 4 B = 48 KB)
/// stay in L2 between chunks, however long the prefill.
const ROW_SLAB: usize = 256;
/// Rows per micro-kernel call: 8 rows × 3 vectors = 24 accumulators, with the 3 panel vectors
/// and the broadcast inside the 32 registers. Slabs but the last are whole blocks of them.
const ROW_BLOCK: usize = 8;

/// Rows per slab: as few slabs as [`ROW_SLAB`] allows, as even as whole row blocks allow. Cut at
/// [`ROW_SLAB`] every time, a 266-row step (two colliding prompts and the running decode rows)
/// would end in a 10-row pass that reads the whole weight for a few rows' work; two passes of
/// 136 and 130 rows read it as often and keep every pass compute-bound.
fn slab_len(rows: usize) -> usize {
    rows.div_ceil(rows.div_ceil(ROW_SLAB).max(1)).next_multiple_of(ROW_BLOCK).clamp(1, ROW_SLAB)
}

/// One call's work as tiles, one panel's columns for one row slab each, slab after slab, which
/// the team's threads claim as they come free ([`openmp::Claims`]): each tile's values are the
/// same whichever thread computes it.
struct Tiles {
    panels: Panels,
    rows: usize,
    slab: usize,
    /// Panels of the output: tiles per slab.
    across: usize,
    /// Threads to run them: `threads`, but never more than tiles.
    team: usize,
    claims: openmp::Claims,
}

impl Tiles {
    /// The tiles of `rows` rows of `panels`' columns, shared out over up to `threads` threads.
    fn new(panels: Panels, rows: usize, threads: usize) -> Self {
        let (slab, across) = (slab_len(rows), panels.padded.div_ceil(PANEL_WIDTH));
        let count = rows.div_ceil(slab) * across;
        let team = threads.min(count).max(1);
        Tiles { panels, rows, slab, across, team, claims: openmp::Claims::new(count, team) }
    }

    /// Tile `i`'s rows and columns.
    fn tile(&self, i: usize) -> (Range<usize>, Range<usize>) {
        let (slab, panel) = (i / self.across, i % self.across);
        let rows = slab * self.slab..((slab + 1) * self.slab).min(self.rows);
        (rows, panel * PANEL_WIDTH..((panel + 1) * PANEL_WIDTH).min(self.panels.out_features))
    }

    /// Runs `f(rows, cols, then)` on every tile thread `thread` claims, `then` being the columns
    /// of its next claim: a claim ahead, so a pass can prefetch the weight the thread reads next.
    fn claim_each(&self, thread: usize, mut f: impl FnMut(Range<usize>, Range<usize>, Option<Range<usize>>)) {
        let mut claim = self.claims.take(thread).map(|i| self.tile(i));
        while let Some((rows, cols)) = claim {
            claim = self.claims.take(thread).map(|i| self.tile(i));
            f(rows, cols, claim.as_ref().map(|(_, then)| then.clone()));
        }
    }
}

/// # Safety
/// As [`Job::run`], for both jobs.
unsafe fn run_gated(gate: &Job<'_>, up: &Job<'_>, tiles: &Tiles, thread: usize, out: *mut f32) {
    #[cfg(target_arch = "x86_64")]
    if avx512::available() && gate.panels.in_features > 0 {
        return avx512::run_gated(gate, up, tiles, thread, out);
    }
    tiles.claim_each(thread, |rows, cols, _| run_gated_portable(gate, up, rows, cols, out));
}

/// The reference loop: both products of a tile, then the activation.
///
/// # Safety
/// As [`run_gated`].
unsafe fn run_gated_portable(
    gate: &Job<'_>,
    up: &Job<'_>,
    rows: Range<usize>,
    cols: Range<usize>,
    out: *mut f32,
) {
    let width = gate.panels.out_features;
    for r in rows {
        let (g, u): (Vec<f32>, Vec<f32>) = cols.clone().map(|col| (gate.dot(r, col), up.dot(r, col))).unzip();
        silu_mul(&g, &u, std::slice::from_raw_parts_mut(out.add(r * width + cols.start), cols.len()));
    }
}

/// One call's operands, shared by the team.
#[derive(Clone, Copy)]
struct Job<'a> {
    x: &'a [f32],
    packed: &'a [f32],
    bias: Option<&'a [f32]>,
    panels: Panels,
}

impl Job<'_> {
    /// The tiles thread `thread` claims from `tiles`.
    ///
    /// # Safety
    /// `out` must address `rows * out_features` elements, of which no other thread writes the
    /// tiles this one claims.
    unsafe fn run(&self, tiles: &Tiles, thread: usize, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() && self.panels.in_features > 0 {
            return avx512::run(self, tiles, thread, out);
        }
        tiles.claim_each(thread, |rows, cols, _| self.run_portable(rows, cols, out));
    }

    /// The reference loop, for CPUs without AVX-512 (and the tests' yardstick).
    unsafe fn run_portable(&self, rows: Range<usize>, cols: Range<usize>, out: *mut f32) {
        for r in rows {
            for col in cols.clone() {
                *out.add(r * self.panels.out_features + col) = self.dot(r, col);
            }
        }
    }

    /// `out[r, col]` the plain way.
    fn dot(&self, r: usize, col: usize) -> f32 {
        let k_len = self.panels.in_features;
        let row = &self.x[r * k_len..(r + 1) * k_len];
        let dot: f32 = row.iter().enumerate().map(|(k, v)| v * self.packed[self.panels.index(col, k)]).sum();
        dot + self.bias.map_or(0.0, |b| b[col])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{linear, values};

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, shape: GemmShape) -> Vec<f32> {
        linear(x, w, bias, shape.rows, shape.out_features, shape.in_features)
    }

    fn packed(w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut packed = vec![f32::NAN; packed_len(n, k)];
        pack_weight(w, &mut packed, n, k, 2).unwrap();
        packed
    }

    /// `w` (`[2 * width, k]`) as [`gemm_silu_mul`] takes it: each half packed on its own.
    fn packed_halves(w: &[f32], width: usize, k: usize) -> Vec<f32> {
        let (gate, up) = w.split_at(width * k);
        [packed(gate, width, k), packed(up, width, k)].concat()
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}[{i}]: {g} vs {w}");
        }
    }

    #[test]
    fn slabs_are_as_few_and_as_even_as_whole_row_blocks_allow() {
        for rows in [1, 8, 255, 256, 257, 266, 300, 512, 513, 1000] {
            let size = slab_len(rows);
            let cut: Vec<_> = (0..rows).step_by(size).map(|s| s..(s + size).min(rows)).collect();
            assert_eq!(cut.len(), rows.div_ceil(ROW_SLAB), "{rows} rows");
            assert!(size <= ROW_SLAB && (size.is_multiple_of(ROW_BLOCK) || cut.len() == 1), "{rows} rows");
            // The last is short by less than a row block per slab (the sizes round up to blocks).
            let last = cut.last().unwrap().len();
            assert!(last + cut.len() * ROW_BLOCK > size, "{rows} rows: {cut:?}");
        }
    }

    #[test]
    fn the_tiles_cover_every_output_once_slab_after_slab() {
        for (rows, n) in [(1, 17), (3, 48), (8, 49), (266, 100), (600, 1153)] {
            let tiles = Tiles::new(Panels::new(n, 4), rows, 1);
            let mut seen = vec![0u8; rows * n];
            let mut last_slab = 0;
            tiles.claim_each(0, |rows, cols, then| {
                assert!(rows.start >= last_slab, "slab {rows:?} after {last_slab}");
                last_slab = rows.start;
                assert!(cols.start % PANEL_WIDTH == 0 && cols.len() <= PANEL_WIDTH && !cols.is_empty());
                assert!(then.is_none_or(|t| t.start % PANEL_WIDTH == 0));
                for r in rows {
                    cols.clone().for_each(|c| seen[r * n + c] += 1);
                }
            });
            assert!(seen.iter().all(|&s| s == 1), "{rows} x {n}");
        }
    }

    #[test]
    fn matches_the_reference() {
        // Row counts around the 8-row block, column counts around vectors and panels, k around
        // the 128-long chunk; 257, 300 and 520 rows take two and three slabs of at most 256. One
        // row takes its own loop, four panel rows at a time (k = 5 and 129 leave one over).
        let cases = [
            (3, 40, 96),
            (8, 48, 128),
            (13, 100, 129),
            (32, 896, 300),
            (1, 17, 5),
            (1, 100, 129),
            (1, 1153, 96),
            (300, 64, 33),
            (257, 40, 7),
            (520, 20, 9),
        ];
        for (rows, n, k) in cases {
            let shape = GemmShape { rows, out_features: n, in_features: k };
            let (x, w, b) = (values(rows * k, 2), values(n * k, 3), values(n, 4));
            let p = packed(&w, n, k);
            for bias in [None, Some(b.as_slice())] {
                for threads in [1, 2] {
                    let mut out = vec![f32::NAN; rows * n];
                    gemm(&x, &p, bias, &mut out, shape, threads).unwrap();
                    assert_close(&out, &reference(&x, &w, bias, shape), &format!("{shape:?} {threads}"));
                }
            }
        }
    }

    #[test]
    fn gated_is_the_gemm_then_silu_and_mul_bit_for_bit() {
        // One row, a few rows, rows across the 256-row slab; widths around vectors and panels.
        for (rows, width, k) in [(1, 40, 96), (5, 100, 129), (9, 48, 7), (300, 70, 33)] {
            let (x, w, b) = (values(rows * k, 9), values(2 * width * k, 10), values(2 * width, 11));
            let both = packed_halves(&w, width, k);
            let merged = packed(&w, 2 * width, k);
            for bias in [None, Some(b.as_slice())] {
                let mut product = vec![f32::NAN; rows * 2 * width];
                let shape = GemmShape { rows, out_features: 2 * width, in_features: k };
                gemm(&x, &merged, bias, &mut product, shape, 2).unwrap();
                let mut want = vec![f32::NAN; rows * width];
                crate::activation::silu_and_mul(&product, width, &mut want, 1).unwrap();
                for threads in [1, 2] {
                    let mut got = vec![f32::NAN; rows * width];
                    let shape = GemmShape { rows, out_features: width, in_features: k };
                    gemm_silu_mul(&x, &both, bias, &mut got, shape, threads).unwrap();
                    assert_eq!(got, want, "{shape:?} bias {} threads {threads}", bias.is_some());
                }
            }
        }
    }

    #[test]
    fn the_portable_gated_loop_agrees_with_the_reference() {
        let (rows, width, k) = (3, 20, 11);
        let (x, w) = (values(rows * k, 12), values(2 * width * k, 13));
        let both = packed_halves(&w, width, k);
        let panels = Panels::new(width, k);
        let gate = Job { x: &x, packed: &both[..panels.len()], bias: None, panels };
        let up = Job { packed: &both[panels.len()..], ..gate };
        let mut got = vec![f32::NAN; rows * width];
        // SAFETY: one thread, every column, `got` sized to the shape.
        unsafe { run_gated_portable(&gate, &up, 0..rows, 0..width, got.as_mut_ptr()) };
        let product = reference(&x, &w, None, GemmShape { rows, out_features: 2 * width, in_features: k });
        let mut want = vec![0.0; rows * width];
        crate::activation::silu_and_mul(&product, width, &mut want, 1).unwrap();
        assert_close(&got, &want, "portable gated");
    }

    #[test]
    fn the_portable_loop_agrees_with_the_reference() {
        let shape = GemmShape { rows: 5, out_features: 70, in_features: 19 };
        let (x, w, b) = (values(95, 5), values(70 * 19, 6), values(70, 7));
        let p = packed(&w, 70, 19);
        let job = Job { x: &x, packed: &p, bias: Some(&b), panels: Panels::new(70, 19) };
        let mut out = vec![f32::NAN; 5 * 70];
        // SAFETY: one thread, every column, `out` sized to the shape.
        unsafe { job.run_portable(0..5, 0..70, out.as_mut_ptr()) };
        assert_close(&out, &reference(&x, &w, Some(&b), shape), "portable");
    }

    #[test]
    fn no_input_features_leaves_the_bias() {
        let shape = GemmShape { rows: 4, out_features: 20, in_features: 0 };
        let b = values(20, 8);
        let mut out = vec![f32::NAN; 80];
        gemm(&[], &[], Some(&b), &mut out, shape, 2).unwrap();
        assert_close(&out, &b.repeat(4), "k = 0");
    }

    #[test]
    fn refuses_buffers_that_do_not_fit() {
        let shape = GemmShape { rows: 3, out_features: 20, in_features: 4 };
        let mut out = vec![0.0f32; 60];
        let err = gemm(&[0.0; 12], &[0.0; 80], None, &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "packed", expected: 128, actual: 80 });
        let err = gemm(&[0.0; 11], &[0.0; 128], None, &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "x", expected: 12, actual: 11 });
        let err = pack_weight(&[0.0; 80], &mut [0.0; 80], 20, 4, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "packed", expected: 128, actual: 80 });
    }
}
