//! `out = x · weightᵀ + bias` from a bf16 weight packed once into panels of column pairs
//! ([`pack_weight_bf16`]), accumulated in f32: the linear layers of a bf16 model, one decode row
//! to a prefill slab. `x`, `bias` and `out` are f32 or bf16 ([`Element`]); `x` is widened to f32
//! (or, bf16 on the AVX512-BF16 path, paired up) once per call, and each result is rounded to the
//! output type once.
//!
//! Paths ([`Bf16Kernel`], the widest the CPU runs unless asked for another):
//! - `Amx`: AMX tiles (`tdpbf16ps`), 32 rows × 32 columns of sums per block, for bf16 `x`; the
//!   rows and `k` short of whole tiles take the `Avx512Bf16` loop (module `amx`).
//! - `Avx512Bf16`: `vdpbf16ps`, two multiply-adds of bf16 pairs per f32 lane, 8 rows × 48
//!   columns of accumulators (module `avx512`), for bf16 `x`; f32 `x` takes `Avx512`, so it is
//!   never rounded.
//! - `Avx512`: AVX-512F, each load of 32 weights widened in registers to the even-`k` and odd-`k`
//!   vectors (a shift and a mask), 8 rows × 48 columns.
//! - `Avx2`: the same with 8-lane vectors, 6 rows × 16 columns (12 accumulators of the 16
//!   registers), or a whole panel for one or two rows, where the product streams the weight
//!   (module `avx2`).
//! - `Portable`: a plain loop over the same layout, for any CPU and as the tests' yardstick.
//!
//! Costs: the weight is half the fp32 GEMM's bytes; `x` is read in place where its memory
//! already has the loop's form (f32 `x` for the widening loops, bf16 `x` for the pair loops,
//! `in_features` even), else copied once by the team. Rows go by in slabs whose `x` (≤ 4 MB)
//! stays in L3 while every tile of the thread's columns passes over it; a tile's weights stay in
//! L2 while the slab's row blocks reuse them.
//! Threads of the OpenMP team take contiguous ranges of 16 output columns.

use std::any::TypeId;
use std::borrow::Cow;
use std::ops::Range;

use crate::element::{as_f32, Bf16};
use crate::error::{check_len, KernelError};
use crate::gemm::{GemmShape, PANEL_WIDTH};
use crate::{openmp, Element};

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod pack;

pub use pack::{pack_weight_bf16, pack_weight_rows_bf16, packed_len_bf16};
use pack::{PairPanels, PAD};

/// Most bytes of `x` per slab of rows: while a slab passes, a tile's weights are read from memory
/// once and from L2 by the slab's other row blocks, and the slab's `x` comes from L3 (shared by
/// the threads, which take the same rows). Measured on the AVX2 machine (1 thread, CPU time,
/// 896 → 4864 at 32 and 128 rows): 128 KB 38/37 GFLOP/s, 256 KB 41/45, 512 KB 46/52,
/// 1 MB 57/61, 4 MB 58/65; 9728 → 896 moved less (57-60, 59-70).
const SLAB_BYTES: usize = 4 << 20;

/// Which loop computes [`gemm_bf16`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Kernel {
    Portable,
    Avx2,
    Avx512,
    Avx512Bf16,
    Amx,
}

impl Bf16Kernel {
    /// Every kernel, narrowest first.
    pub const ALL: [Bf16Kernel; 5] = [Self::Portable, Self::Avx2, Self::Avx512, Self::Avx512Bf16, Self::Amx];

    /// The widest kernel this CPU runs.
    pub fn best() -> Self {
        Self::ALL.into_iter().rev().find(|k| k.runs_here()).unwrap_or(Self::Portable)
    }

    /// Whether this CPU has the instructions the kernel needs.
    pub fn runs_here(self) -> bool {
        match self {
            Self::Portable => true,
            Self::Avx2 => crate::simd::has_avx2_fma(),
            Self::Avx512 => crate::simd::has_avx512f(),
            Self::Avx512Bf16 => has_avx512_bf16(),
            Self::Amx => has_amx_bf16(),
        }
    }

    /// The kernel's name: `portable`, `avx2`, `avx512`, `avx512_bf16`, `amx`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Portable => "portable",
            Self::Avx2 => "avx2",
            Self::Avx512 => "avx512",
            Self::Avx512Bf16 => "avx512_bf16",
            Self::Amx => "amx",
        }
    }

    /// The kernel of [`Self::name`] `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// Whether the CPU has AVX512-BF16's dot products (and AVX-512F around them).
fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::simd::has_avx512f() && std::arch::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether the CPU has AMX's bf16 tiles, this process may use them, and AVX512-BF16 takes the
/// rows and `k` short of a tile.
fn has_amx_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx512_bf16()
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && amx::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[r, n] = Σ_k x[r, k] · weight[n, k] + bias[n]`, `packed` being [`pack_weight_bf16`]'s
/// form of `weight`, summed in f32 by `kernel`.
///
/// # Errors
/// A buffer whose length does not fit `shape`, or a `kernel` this CPU cannot run.
pub fn gemm_bf16<T: Element>(
    x: &[T],
    packed: &[Bf16],
    bias: Option<&[T]>,
    out: &mut [T],
    shape: GemmShape,
    kernel: Bf16Kernel,
    threads: usize,
) -> Result<(), KernelError> {
    let GemmShape { rows, out_features, in_features } = shape;
    let panels = PairPanels::new(out_features, in_features);
    check_len("x", x.len(), rows * in_features)?;
    check_len("packed", packed.len(), panels.len())?;
    check_len("out", out.len(), rows * out_features)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    if !kernel.runs_here() {
        let limit = format!("one this CPU runs (the best here is {})", Bf16Kernel::best().name());
        return Err(KernelError::Param { name: "kernel", limit, value: kernel.name().into() });
    }
    if out.is_empty() {
        return Ok(());
    }
    // `vdpbf16ps` and the tiles multiply bf16 pairs: fp32 activations would be rounded to bf16 on
    // the way, so they take the widening AVX-512F loop and stay exact.
    let kernel = match kernel {
        Bf16Kernel::Avx512Bf16 | Bf16Kernel::Amx if TypeId::of::<T>() == TypeId::of::<f32>() => {
            Bf16Kernel::Avx512
        }
        other => other,
    };
    let (xf, xp) = match kernel {
        Bf16Kernel::Avx512Bf16 | Bf16Kernel::Amx => {
            (Cow::Borrowed(&[][..]), bf16_pairs(x, rows, panels, threads))
        }
        _ => (widened(x, rows, panels, threads), Cow::Borrowed(&[][..])),
    };
    let sink = Sink { out: out.as_mut_ptr(), n: out_features, bias };
    let job = Job { x: &xf, x_pairs: &xp, packed, panels, rows, sink };
    let vectors = panels.padded / PAD;
    openmp::parallel(threads.clamp(1, vectors), |thread, team| {
        let share = openmp::share(vectors, thread, team);
        let cols = share.start * PAD..(share.end * PAD).min(out_features);
        // SAFETY: each thread writes only its columns `cols` of `out`, whose length was checked;
        // `kernel` runs here.
        unsafe { job.run(kernel, cols) };
    });
    Ok(())
}

/// `x` as the widening loops read it: f32, rows `2 · pairs` apart (an odd `in_features` padded
/// with a zero). f32 `x` with an even `in_features` already is that and is borrowed.
fn widened<T: Element>(x: &[T], rows: usize, panels: PairPanels, threads: usize) -> Cow<'_, [f32]> {
    let k = panels.in_features;
    if let Some(x) = as_f32(x).filter(|_| k.is_multiple_of(2)) {
        return Cow::Borrowed(x);
    }
    Cow::Owned(copied_rows(x, rows, k, 2 * panels.pairs, threads, |row, dst: &mut [f32]| {
        dst.iter_mut().zip(row).for_each(|(d, s)| *d = s.to_f32());
    }))
}

/// `x` rounded to bf16, two neighbours per 32-bit word as the packed weight holds them, rows
/// `pairs` words apart. bf16 `x` with an even `in_features`, 4-byte aligned, already is that
/// and is borrowed.
fn bf16_pairs<T: Element>(x: &[T], rows: usize, panels: PairPanels, threads: usize) -> Cow<'_, [u32]> {
    let (k, pairs) = (panels.in_features, panels.pairs);
    if TypeId::of::<T>() == TypeId::of::<Bf16>()
        && k.is_multiple_of(2)
        && x.as_ptr().cast::<u32>().is_aligned()
    {
        // SAFETY: `T` is `Bf16` (two bytes, no padding); the words are aligned and lie in `x`.
        return Cow::Borrowed(unsafe { std::slice::from_raw_parts(x.as_ptr().cast(), x.len() / 2) });
    }
    let bits = |row: &[T], i: usize| row.get(i).map_or(0, |v| u32::from(Bf16::from_f32(v.to_f32()).0));
    Cow::Owned(copied_rows(x, rows, k, pairs, threads, |row, dst: &mut [u32]| {
        for (p, word) in dst.iter_mut().enumerate() {
            *word = bits(row, 2 * p) | bits(row, 2 * p + 1) << 16;
        }
    }))
}

/// `rows` rows of `width` values (zeroed, then `fill(x row, out row)`), the team taking a share of
/// the rows each: a copy of a prefill slab's `x` costs as much as a fair part of its product.
fn copied_rows<T: Element, U: Copy + Default + Send>(
    x: &[T],
    rows: usize,
    k: usize,
    width: usize,
    threads: usize,
    fill: impl Fn(&[T], &mut [U]) + Sync,
) -> Vec<U> {
    let mut out = vec![U::default(); rows * width];
    let dst = openmp::SharedMut(out.as_mut_ptr());
    openmp::parallel(threads.clamp(1, rows.max(1)), |thread, team| {
        for r in openmp::share(rows, thread, team) {
            // SAFETY: row `r` of `out` (`width` values) belongs to this thread alone.
            let row = unsafe { std::slice::from_raw_parts_mut(dst.get().add(r * width), width) };
            fill(&x[r * k..(r + 1) * k], row);
        }
    });
    out
}

/// Where results go: row `r`, column `c` of `out` (`n` columns), plus `bias[c]`.
struct Sink<'a, T> {
    out: *mut T,
    n: usize,
    bias: Option<&'a [T]>,
}

impl<T: Element> Sink<'_, T> {
    /// Writes `values` (f32 sums) to row `row` from column `col`, adding the bias and rounding.
    ///
    /// # Safety
    /// The columns lie inside `out` and belong to the calling thread.
    #[inline(always)]
    unsafe fn write(&self, row: usize, col: usize, values: &[f32]) {
        let dst = self.out.add(row * self.n + col);
        for (j, v) in values.iter().enumerate() {
            let bias = self.bias.map_or(0.0, |b| b[col + j].to_f32());
            *dst.add(j) = T::from_f32(v + bias);
        }
    }
}

/// One call's operands, shared by the team.
struct Job<'a, T> {
    /// `x` widened, rows `2 · pairs` apart (the f32 paths).
    x: &'a [f32],
    /// `x` as bf16 pairs, rows `pairs` apart (the `vdpbf16ps` path).
    x_pairs: &'a [u32],
    packed: &'a [Bf16],
    panels: PairPanels,
    rows: usize,
    sink: Sink<'a, T>,
}

// SAFETY: `Sink::out` is written by the threads at disjoint columns only (see `gemm_bf16`).
unsafe impl<T: Element> Sync for Job<'_, T> {}

/// Columns `col..col + span` inside one panel: their first word, and the words between rows.
#[derive(Clone, Copy)]
struct Tile {
    words: *const u32,
    stride: usize,
    col: usize,
    span: usize,
}

impl<T: Element> Job<'_, T> {
    /// # Safety
    /// No other thread writes the columns `cols`; `kernel` runs on this CPU.
    unsafe fn run(&self, kernel: Bf16Kernel, cols: Range<usize>) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Avx2 => avx2::run(self, cols),
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Avx512 => avx512::run(self, cols),
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Avx512Bf16 => avx512::run_dot(self, cols),
            #[cfg(target_arch = "x86_64")]
            Bf16Kernel::Amx => amx::run(self, cols),
            _ => self.run_portable(cols),
        }
    }

    /// The tile of columns `col..col + span`, which lie in one panel.
    fn tile(&self, col: usize, span: usize) -> Tile {
        let panel = col / PANEL_WIDTH;
        let at = self.panels.offset(panel) + (col % PANEL_WIDTH) * 2;
        // `wrapping_add`: with no input features the weight is empty and never read.
        Tile {
            words: self.packed.as_ptr().wrapping_add(at).cast(),
            stride: self.panels.width(panel),
            col,
            span,
        }
    }

    /// The tiles of `cols`, at most `widest` columns each and never across a panel.
    fn tiles(&self, cols: Range<usize>, widest: usize) -> impl Iterator<Item = Tile> + '_ {
        let mut col = cols.start;
        std::iter::from_fn(move || {
            if col >= cols.end {
                return None;
            }
            let room = PANEL_WIDTH - col % PANEL_WIDTH;
            let span = room.min(widest).min(cols.end - col);
            col += span;
            Some(self.tile(col - span, span))
        })
    }

    /// Slabs of rows whose `x` (`row_bytes` a row) is at most [`SLAB_BYTES`], in whole `block`s.
    fn slabs(&self, row_bytes: usize, block: usize) -> impl Iterator<Item = Range<usize>> {
        let slab = (SLAB_BYTES / row_bytes.max(1) / block).max(1) * block;
        let rows = self.rows;
        (0..rows).step_by(slab).map(move |start| start..(start + slab).min(rows))
    }

    /// The reference loop, for CPUs without AVX2 (and for `FERROLLM_CPU_GEMM=portable`).
    unsafe fn run_portable(&self, cols: Range<usize>) {
        let (k_len, stride) = (self.panels.in_features, 2 * self.panels.pairs);
        for r in 0..self.rows {
            let row = &self.x[r * stride..r * stride + k_len];
            for col in cols.clone() {
                let dot: f32 = row
                    .iter()
                    .enumerate()
                    .map(|(k, v)| v * self.packed[self.panels.index(col, k)].to_f32())
                    .sum();
                self.sink.write(r, col, &[dot]);
            }
        }
    }
}

#[cfg(test)]
mod tests;
