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
    let job = Job { x, packed, bias, panels, rows: shape.rows };
    // SAFETY: each thread writes only its columns `cols` of `out`, whose length was checked.
    for_each_column_share(panels, out, threads, |cols, out| unsafe { job.run(cols, out) });
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
    let gate = Job { x, packed: gate_w, bias: gate_b, panels, rows: shape.rows };
    let up = Job { packed: up_w, bias: up_b, ..gate };
    // SAFETY: each thread writes only its columns `cols` of `out`, whose length was checked.
    for_each_column_share(panels, out, threads, |cols, out| unsafe { run_gated(&gate, &up, cols, out) });
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

/// Runs `run(cols, out)` on the OpenMP team, each thread with a contiguous range of 16-column
/// vectors of `out`'s `panels.out_features` columns; nothing when `out` is empty.
fn for_each_column_share(
    panels: Panels,
    out: &mut [f32],
    threads: usize,
    run: impl Fn(Range<usize>, *mut f32) + Sync,
) {
    if out.is_empty() {
        return;
    }
    let dst = openmp::SharedMut(out.as_mut_ptr());
    let vectors = panels.padded / LANES;
    openmp::parallel(threads.min(vectors), |thread, team| {
        let share = openmp::share(vectors, thread, team);
        run(share.start * LANES..(share.end * LANES).min(panels.out_features), dst.get());
    });
}

/// # Safety
/// As [`Job::run`], for both jobs.
unsafe fn run_gated(gate: &Job<'_>, up: &Job<'_>, cols: Range<usize>, out: *mut f32) {
    if cols.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx512::available() && gate.panels.in_features > 0 {
        return avx512::run_gated(gate, up, cols, out);
    }
    run_gated_portable(gate, up, cols, out);
}

/// The reference loop: both products of this thread's columns, then the activation.
///
/// # Safety
/// As [`run_gated`].
unsafe fn run_gated_portable(gate: &Job<'_>, up: &Job<'_>, cols: Range<usize>, out: *mut f32) {
    let width = gate.panels.out_features;
    let (mut g, mut u) = (vec![0.0; gate.rows * width], vec![0.0; gate.rows * width]);
    gate.run_portable(cols.clone(), g.as_mut_ptr());
    up.run_portable(cols.clone(), u.as_mut_ptr());
    for r in 0..gate.rows {
        let at = r * width;
        let dst = std::slice::from_raw_parts_mut(out.add(at + cols.start), cols.len());
        silu_mul(&g[at + cols.start..at + cols.end], &u[at + cols.start..at + cols.end], dst);
    }
}

/// One call's operands, shared by the team.
#[derive(Clone, Copy)]
struct Job<'a> {
    x: &'a [f32],
    packed: &'a [f32],
    bias: Option<&'a [f32]>,
    panels: Panels,
    rows: usize,
}

impl Job<'_> {
    /// # Safety
    /// `out` must address `rows * out_features` elements, of which no other thread writes the
    /// columns in `cols`.
    unsafe fn run(&self, cols: Range<usize>, out: *mut f32) {
        if cols.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if avx512::available() && self.panels.in_features > 0 {
            return avx512::run(self, cols, out);
        }
        self.run_portable(cols, out);
    }

    /// The reference loop, for CPUs without AVX-512 (and the tests' yardstick).
    unsafe fn run_portable(&self, cols: Range<usize>, out: *mut f32) {
        let (k_len, n_len) = (self.panels.in_features, self.panels.out_features);
        for r in 0..self.rows {
            let row = &self.x[r * k_len..(r + 1) * k_len];
            for col in cols.clone() {
                let dot: f32 =
                    row.iter().enumerate().map(|(k, v)| v * self.packed[self.panels.index(col, k)]).sum();
                *out.add(r * n_len + col) = dot + self.bias.map_or(0.0, |b| b[col]);
            }
        }
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
        let gate = Job { x: &x, packed: &both[..panels.len()], bias: None, panels, rows };
        let up = Job { packed: &both[panels.len()..], ..gate };
        let mut got = vec![f32::NAN; rows * width];
        // SAFETY: one thread, every column, `got` sized to the shape.
        unsafe { run_gated_portable(&gate, &up, 0..width, got.as_mut_ptr()) };
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
        let job = Job { x: &x, packed: &p, bias: Some(&b), panels: Panels::new(70, 19), rows: 5 };
        let mut out = vec![f32::NAN; 5 * 70];
        // SAFETY: one thread, every column, `out` sized to the shape.
        unsafe { job.run_portable(0..70, out.as_mut_ptr()) };
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
