//! `out = x · Wᵀ + bias` where `W` is a GGUF tensor's own blocks, read in place (usually a view
//! of the memory-mapped file): nothing is repacked or decoded into memory.
//!
//! The rows of `x` are quantized once per call ([`super::act`]); then the OpenMP team splits the
//! output features, each thread streaming its weight rows once from memory. Rows of `x` go in
//! tiles of up to [`MAX_TILE`], each weight block unpacked once per tile ([`super::dot`]); with
//! more rows than one tile, a thread takes its weight rows in chunks of ~[`CHUNK_BYTES`] that
//! stay in its L2 cache while every tile passes over them, so memory still serves each weight
//! byte once per call.
//!
//! A layer whose weight the file holds as several tensors (q, k and v; gate and up) passes them
//! as one stack ([`matmul_stacked`]): their output features side by side in `out`, one team and
//! one quantization of `x` for all of them, where separate calls paid a fork/join, a quantization
//! and a concatenation each.
//!
//! Invariants: weight row `n` starts at byte `n · row_stride` and holds `in_features /
//! block_len` whole blocks; a tensor-parallel shard is such a view (the caller slices whole
//! blocks). An `interleaved` weight is instead Q4_0, Q4_1 or Q8_0 re-laid in groups of 16 rows
//! ([`super::interleaved`]); a thread then takes the groups whose first row falls in its share. Results differ from `x · dequantize(W)ᵀ` by the activation rounding bounded in
//! [`super::act`], or with [`Activations::Residual`] by its square.

use std::ops::Range;

use super::act::{QuantizedRows, Row};
use super::dot::{rows_dot, Isa, RowsDot};
use super::interleaved::{self, group_dot, GroupDot, GROUP};
use super::GgmlType;
use crate::error::check_len;
use crate::simd::{prefetch_stream, STREAM_AHEAD};
use crate::{openmp, KernelError};

/// Most rows of `x` one pass over a weight block serves: four accumulators per sub-block keep
/// the AVX2 registers free of spills.
pub const MAX_TILE: usize = 4;
/// Weight bytes a thread keeps in cache while the tiles of `x` pass over them.
const CHUNK_BYTES: usize = 128 * 1024;
/// Fewer output rows per thread than this run on the calling thread alone.
const MIN_ROWS_PER_THREAD: usize = 16;
// A residual pair of rows must fall in one tile (see `Job::store`).
const _: () = assert!(MAX_TILE.is_multiple_of(2));

/// How the rows of `x` are quantized to meet the weight's integer blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// 8-bit blocks (as llama.cpp's): each element within `max|x| / 254` of its group.
    Int8,
    /// 8-bit blocks and the 8-bit blocks of what they leave over, each pair's products summed:
    /// within `max|x| / 254²`, at twice the integer work of `Int8` and the same weight reads.
    /// For the LM head, where 8-bit rounding of the last hidden state can flip a greedy token.
    Residual,
}

/// A GGUF weight `[out_features, in_features]` as its blocks.
#[derive(Clone, Copy, Debug)]
pub struct QuantWeight<'a> {
    pub ggml_type: GgmlType,
    /// From the first row's first byte to the last row's last byte (or further).
    pub data: &'a [u8],
    /// Bytes from one row's start to the next's; at least a row's blocks.
    pub row_stride: usize,
    pub out_features: usize,
    /// A multiple of the type's block length.
    pub in_features: usize,
    /// `data` holds the rows re-laid by [`interleaved::interleave`] (`row_stride` unused).
    pub interleaved: bool,
}

impl QuantWeight<'_> {
    /// Bytes of one row's blocks.
    pub fn row_bytes(&self) -> usize {
        self.in_features / self.ggml_type.block_len() * self.ggml_type.block_bytes()
    }

    /// Bytes of one group of an interleaved weight.
    fn group_bytes(&self) -> usize {
        GROUP * self.row_bytes()
    }

    fn row(&self, n: usize) -> &[u8] {
        &self.data[n * self.row_stride..][..self.row_bytes()]
    }

    fn check(&self) -> Result<(), KernelError> {
        let t = self.ggml_type;
        if !supported(t) {
            return Err(KernelError::Value {
                name: "ggml_type",
                limit: "a quantized type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K)".into(),
                value: t as i64,
            });
        }
        if !self.in_features.is_multiple_of(t.block_len()) {
            return Err(KernelError::Value {
                name: "in_features",
                limit: format!("a multiple of {t:?}'s block length {}", t.block_len()),
                value: self.in_features as i64,
            });
        }
        if self.interleaved {
            return self.check_interleaved();
        }
        if self.out_features > 1 && self.row_stride < self.row_bytes() {
            return Err(KernelError::Value {
                name: "row_stride",
                limit: format!("at least a row's {} bytes", self.row_bytes()),
                value: self.row_stride as i64,
            });
        }
        let needed =
            self.out_features.checked_sub(1).map_or(0, |last| last * self.row_stride + self.row_bytes());
        if self.data.len() < needed {
            return Err(KernelError::Value {
                name: "data",
                limit: format!(
                    "at least {needed} bytes ({} rows of stride {})",
                    self.out_features, self.row_stride
                ),
                value: self.data.len() as i64,
            });
        }
        Ok(())
    }

    fn check_interleaved(&self) -> Result<(), KernelError> {
        if !interleaved::supported(self.ggml_type) {
            return Err(KernelError::Value {
                name: "ggml_type",
                limit: "Q4_0, Q4_1 or Q8_0 for an interleaved weight".into(),
                value: self.ggml_type as i64,
            });
        }
        let needed = interleaved::interleaved_len(self.ggml_type, self.out_features, self.in_features);
        if self.data.len() < needed {
            return Err(KernelError::Value {
                name: "data",
                limit: format!("at least {needed} bytes ({} interleaved rows)", self.out_features),
                value: self.data.len() as i64,
            });
        }
        Ok(())
    }
}

/// Whether [`matmul`] computes from blocks of `ggml_type` (the quantized formats; not F16/BF16).
pub fn supported(ggml_type: GgmlType) -> bool {
    rows_dot::<1>(ggml_type, Isa::Portable).is_some()
}

/// `out[r, n] = Σ_k x[r, k] · W[n, k] + bias[n]` for `rows` rows of `x` (`[rows, in_features]`,
/// row-major), into `out` (`[rows, out_features]`), on up to `threads` threads of the OpenMP
/// team, with the best instruction set this CPU has.
pub fn matmul(
    weight: &QuantWeight<'_>,
    x: &[f32],
    rows: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    matmul_stacked_on(
        Isa::detect(),
        Activations::Int8,
        std::slice::from_ref(weight),
        x,
        rows,
        bias,
        out,
        threads,
    )
}

/// [`matmul`] for the weight made of `weights` stacked along the output features (each may be
/// of its own type; all have the same `in_features`): `out` is `[rows, Σ out_features]`, weight
/// `j`'s columns after those of `0..j`, and `bias` (if any) covers them all.
pub fn matmul_stacked(
    weights: &[QuantWeight<'_>],
    x: &[f32],
    rows: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    matmul_stacked_on(Isa::detect(), Activations::Int8, weights, x, rows, bias, out, threads)
}

/// [`matmul_stacked`] with the products compiled for `isa`, which this CPU must have (see
/// [`Isa::available`]; tests and benchmarks pick each path), and `x` quantized as `activations`
/// says.
#[allow(clippy::too_many_arguments)]
pub fn matmul_stacked_on(
    isa: Isa,
    activations: Activations,
    weights: &[QuantWeight<'_>],
    x: &[f32],
    rows: usize,
    bias: Option<&[f32]>,
    out: &mut [f32],
    threads: usize,
) -> Result<(), KernelError> {
    if !Isa::available().contains(&isa) {
        return Err(KernelError::Value { name: "isa", limit: "one this CPU has".into(), value: isa as i64 });
    }
    let Some(first) = weights.first() else {
        return Err(KernelError::Value { name: "weights", limit: "at least one".into(), value: 0 });
    };
    let in_features = first.in_features;
    for weight in weights {
        weight.check()?;
        if weight.in_features != in_features {
            return Err(KernelError::Value {
                name: "in_features",
                limit: format!("the same for every stacked weight ({in_features})"),
                value: weight.in_features as i64,
            });
        }
    }
    let out_features: usize = weights.iter().map(|w| w.out_features).sum();
    check_len("x", x.len(), rows * in_features)?;
    check_len("out", out.len(), rows * out_features)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    let quantized = Quantized::new(weights, x, activations);
    let pairs = activations == Activations::Residual;
    let mut offset = 0;
    let jobs: Vec<Job<'_>> = weights
        .iter()
        .map(|weight| {
            let job = Job {
                weight,
                x: quantized.for_type(weight.ggml_type),
                pairs,
                bias: bias.map(|b| &b[offset..offset + weight.out_features]),
                kernels: Kernels::new(weight, isa),
                offset,
                out_stride: out_features,
            };
            offset += weight.out_features;
            job
        })
        .collect();
    let team = threads.min(out_features / MIN_ROWS_PER_THREAD).max(1);
    let out = openmp::SharedMut(out.as_mut_ptr());
    openmp::parallel(team, |thread, size| {
        let span = openmp::share(out_features, thread, size);
        for job in &jobs {
            let local = span.start.max(job.offset)..span.end.min(job.offset + job.weight.out_features);
            if !local.is_empty() {
                // SAFETY: threads get disjoint output features (columns of `out`, whose length
                // was checked), `out` outlives `parallel`, and the kernels were picked for this CPU.
                unsafe { job.run(local.start - job.offset..local.end - job.offset, &out) };
            }
        }
    });
    Ok(())
}

/// `x` quantized once per activation block length the stacked weights need (32, 256 or both).
struct Quantized {
    by_len: Vec<(usize, QuantizedRows)>,
}

impl Quantized {
    fn new(weights: &[QuantWeight<'_>], x: &[f32], activations: Activations) -> Self {
        let in_features = weights[0].in_features;
        let mut by_len: Vec<(usize, QuantizedRows)> = Vec::new();
        for weight in weights {
            let len = weight.ggml_type.block_len();
            if !by_len.iter().any(|(l, _)| *l == len) {
                let rows = match activations {
                    Activations::Int8 => QuantizedRows::new(x, in_features, len),
                    Activations::Residual => QuantizedRows::with_residual(x, in_features, len),
                };
                by_len.push((len, rows));
            }
        }
        Quantized { by_len }
    }

    fn for_type(&self, t: GgmlType) -> &QuantizedRows {
        let len = t.block_len();
        &self.by_len.iter().find(|(l, _)| *l == len).expect("quantized for every weight's type").1
    }
}

/// The products for tiles of 1 to [`MAX_TILE`] rows, of single weight rows or of groups.
enum Kernels {
    Rows(RowsDot<1>, RowsDot<2>, RowsDot<3>, RowsDot<4>),
    Groups(GroupDot<1>, GroupDot<2>, GroupDot<3>, GroupDot<4>),
}

impl Kernels {
    fn new(weight: &QuantWeight<'_>, isa: Isa) -> Self {
        let t = weight.ggml_type;
        if let Some(format) = weight.interleaved.then(|| interleaved::Format::of(t)).flatten() {
            return Kernels::Groups(
                group_dot(format, isa),
                group_dot(format, isa),
                group_dot(format, isa),
                group_dot(format, isa),
            );
        }
        let missing = "checked by QuantWeight::check";
        Kernels::Rows(
            rows_dot(t, isa).expect(missing),
            rows_dot(t, isa).expect(missing),
            rows_dot(t, isa).expect(missing),
            rows_dot(t, isa).expect(missing),
        )
    }
}

/// One stacked weight's share of the product: its columns start at `offset` in rows of
/// `out_stride` floats of `out`. With `pairs`, rows `2i` and `2i + 1` of `x` are one row of the
/// input quantized with its residual ([`Activations::Residual`]), and their products add up.
struct Job<'a> {
    weight: &'a QuantWeight<'a>,
    x: &'a QuantizedRows,
    pairs: bool,
    bias: Option<&'a [f32]>,
    kernels: Kernels,
    offset: usize,
    out_stride: usize,
}

impl Job<'_> {
    /// Output features `span` (of this weight) for every row.
    ///
    /// # Safety
    /// `out` addresses `rows * out_stride` floats of which no other thread writes the columns
    /// `offset + span`; the kernels run on this CPU.
    unsafe fn run(&self, span: Range<usize>, out: &openmp::SharedMut<f32>) {
        // Interleaved weights go by groups: those whose first row is in `span`.
        let (span, unit_bytes) = match self.kernels {
            Kernels::Rows(..) => (span, self.weight.row_bytes()),
            Kernels::Groups(..) => {
                (span.start.div_ceil(GROUP)..span.end.div_ceil(GROUP), self.weight.group_bytes())
            }
        };
        let chunk = (CHUNK_BYTES / unit_bytes.max(1)).max(1);
        let rows = self.x.rows();
        let mut start = span.start;
        while start < span.end {
            let units = start..(start + chunk).min(span.end);
            let mut first = 0;
            while first < rows {
                let x = |r: usize| self.x.row(first + r);
                let u = units.clone();
                match (&self.kernels, rows - first) {
                    (Kernels::Rows(one, ..), 1) => self.tile(*one, u, [x(0)], first, out),
                    (Kernels::Rows(_, two, ..), 2) => self.tile(*two, u, [x(0), x(1)], first, out),
                    (Kernels::Rows(_, _, three, _), 3) => {
                        self.tile(*three, u, [x(0), x(1), x(2)], first, out)
                    }
                    (Kernels::Rows(.., four), _) => self.tile(*four, u, [x(0), x(1), x(2), x(3)], first, out),
                    (Kernels::Groups(one, ..), 1) => self.groups(*one, u, [x(0)], first, out),
                    (Kernels::Groups(_, two, ..), 2) => self.groups(*two, u, [x(0), x(1)], first, out),
                    (Kernels::Groups(_, _, three, _), 3) => {
                        self.groups(*three, u, [x(0), x(1), x(2)], first, out)
                    }
                    (Kernels::Groups(.., four), _) => {
                        self.groups(*four, u, [x(0), x(1), x(2), x(3)], first, out)
                    }
                }
                first += MAX_TILE;
            }
            start = units.end;
        }
    }

    /// Rows `first..first + M` of `x` against the interleaved weight's groups `groups`.
    ///
    /// # Safety
    /// As [`Job::run`]; the weight is interleaved and the kernels match its format.
    unsafe fn groups<const M: usize>(
        &self,
        dot: GroupDot<M>,
        groups: Range<usize>,
        xs: [Row<'_>; M],
        first: usize,
        out: &openmp::SharedMut<f32>,
    ) {
        let blocks = self.weight.in_features / super::act::BLOCK;
        for g in groups {
            let dots = dot(self.weight.data.as_ptr().add(g * self.weight.group_bytes()), blocks, &xs);
            for n in g * GROUP..(g * GROUP + GROUP).min(self.weight.out_features) {
                self.store(n, std::array::from_fn::<f32, M, _>(|r| dots[r][n % GROUP]), first, out);
            }
        }
    }

    /// Rows `first..first + M` of `x` against weight rows `features`.
    ///
    /// # Safety
    /// As [`Job::run`].
    unsafe fn tile<const M: usize>(
        &self,
        dot: RowsDot<M>,
        features: Range<usize>,
        xs: [Row<'_>; M],
        first: usize,
        out: &openmp::SharedMut<f32>,
    ) {
        let row_bytes = self.weight.row_bytes();
        for n in features {
            let row = self.weight.row(n);
            if M <= 2 {
                // One or two rows (decode) stream the weight once; more reuse the chunk from L2.
                prefetch_stream(row.as_ptr().wrapping_add(STREAM_AHEAD), row_bytes);
            }
            self.store(n, dot(row, &xs), first, out);
        }
    }

    /// Output feature `n` of rows `first..first + M` of `x` (`dots`), with the bias, into `out`;
    /// with `pairs` each pair summed into one row (`first` and `M` are even: tiles hold
    /// [`MAX_TILE`] rows but for the last, and the row count is even).
    ///
    /// # Safety
    /// As [`Job::run`].
    #[inline(always)]
    unsafe fn store<const M: usize>(
        &self,
        n: usize,
        dots: [f32; M],
        first: usize,
        out: &openmp::SharedMut<f32>,
    ) {
        let bias = self.bias.map_or(0.0, |b| b[n]);
        let at = |row: usize| out.get().add(row * self.out_stride + self.offset + n);
        if self.pairs {
            for (r, pair) in dots.chunks_exact(2).enumerate() {
                *at(first / 2 + r) = pair[0] + pair[1] + bias;
            }
        } else {
            for (r, dot) in dots.into_iter().enumerate() {
                *at(first + r) = dot + bias;
            }
        }
    }
}

#[cfg(test)]
mod tests;
