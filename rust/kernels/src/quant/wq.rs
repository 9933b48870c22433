//! Weight-only int4 and int8 linear layers: the form GPTQ, AWQ and compressed-tensors
//! W4A16/W8A16 checkpoints (symmetric or not) all take once loaded.
//!
//! `out[r, n] = Σ_k x[r, k] · w[n, k] + bias[n]` in f32, where
//! `w[n, k] = q[n, k] · scales[n, g] + mins[n, g]` and `g = k / group_size` (no `mins`: 0).
//! int8 weights are `q: i8 [out, in]` as stored; int4 weights are unsigned nibbles packed by
//! [`pack_int4`] into 16-byte blocks of 32 elements per row (byte `i` of a block holds element
//! `i` in its low nibble and element `i + 16` in its high one; rows padded to whole blocks with
//! zeros). That order unpacks with one zero-extension of 8 bytes to 8 lanes, then an AND for
//! one element per lane and a shift for the other: no shuffles across lanes.
//!
//! One or two rows (decode steps) stream each weight row once, start to end, with the scales
//! and mins beside it, unpacking in registers: per group, the products `q · x` are summed in
//! vector accumulators and scaled once, and the mins cost one multiply-add per group against
//! sums of `x` per group computed once per call. From three rows on, `super::tiled` decodes a
//! tile (12 rows × 256 columns) at a time and runs an f32 micro-kernel over every row of `x`.
//!
//! Invariants checked at the entry: `group_size` divides `in_features` and is 16, a multiple of
//! 32, or `in_features` itself (per channel); every buffer has its shape's length. Costs: the
//! weight is read once per call; `x` is copied only where `in_features` is not a multiple of 32
//! (into a zero-padded copy) and, with mins and one or two rows, summed per group.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::GroupWalk;

use std::borrow::Cow;
use std::ops::Range;

use super::tiled::{tiled_linear, TiledShape, Tiles, K_STEP};
use crate::error::{check_len, KernelError};
use crate::{openmp, simd};

/// Elements per packed int4 block.
pub const INT4_BLOCK: usize = 32;
/// Rows of `x` up to which a call streams the weight row by row; more go through tiles.
pub const ROW_PATH_MAX_ROWS: usize = 2;

/// A quantized weight `[out_features, in_features]`.
#[derive(Clone, Copy, Debug)]
pub enum QWeight<'a> {
    /// Nibbles 0..=15 in [`pack_int4`]'s layout: [`int4_packed_len`] bytes.
    Int4(&'a [u8]),
    /// Signed bytes, row-major.
    Int8(&'a [i8]),
}

/// A weight-only quantized weight: stored values, and per group their scales and mins.
#[derive(Clone, Copy, Debug)]
pub struct WqWeight<'a> {
    pub q: QWeight<'a>,
    pub scales: &'a [f32],
    pub mins: Option<&'a [f32]>,
}

/// `x` is `[rows, in_features]`, `out` `[rows, out_features]`; scales and mins are
/// `[out_features, in_features / group_size]`, all row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WqShape {
    pub rows: usize,
    pub out_features: usize,
    pub in_features: usize,
    pub group_size: usize,
}

/// Bytes of one packed int4 row of `in_features` elements.
pub fn int4_row_bytes(in_features: usize) -> usize {
    in_features.div_ceil(INT4_BLOCK) * INT4_BLOCK / 2
}

/// Bytes [`pack_int4`] writes for an `[out_features, in_features]` weight.
pub fn int4_packed_len(out_features: usize, in_features: usize) -> usize {
    out_features * int4_row_bytes(in_features)
}

/// Packs `q` (`[out_features, in_features]`, one value 0..=15 per byte) into `packed`
/// ([`int4_packed_len`] bytes) in the layout [`wq_linear`] reads; rows split over the team.
pub fn pack_int4(
    q: &[u8],
    packed: &mut [u8],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    check_len("q", q.len(), out_features * in_features)?;
    check_len("packed", packed.len(), int4_packed_len(out_features, in_features))?;
    if let Some(&bad) = q.iter().find(|&&v| v > 15) {
        return Err(KernelError::Value { name: "q", limit: "between 0 and 15".into(), value: bad.into() });
    }
    let row_bytes = int4_row_bytes(in_features);
    openmp::for_each_share(packed, row_bytes, 64, threads, |rows, piece| {
        for (n, dst) in rows.zip(piece.chunks_exact_mut(row_bytes)) {
            pack_row(&q[n * in_features..(n + 1) * in_features], dst);
        }
    });
    Ok(())
}

fn pack_row(q: &[u8], dst: &mut [u8]) {
    let at = |k: usize| q.get(k).copied().unwrap_or(0);
    for (b, block) in dst.chunks_exact_mut(INT4_BLOCK / 2).enumerate() {
        for (i, byte) in block.iter_mut().enumerate() {
            let k = b * INT4_BLOCK + i;
            *byte = at(k) | (at(k + INT4_BLOCK / 2) << 4);
        }
    }
}

/// `out = x · wᵀ + bias` for the quantized `weight` (see the module doc), on up to `threads`
/// threads of the OpenMP team.
pub fn wq_linear(
    x: &[f32],
    weight: WqWeight<'_>,
    bias: Option<&[f32]>,
    out: &mut [f32],
    shape: WqShape,
    threads: usize,
) -> Result<(), KernelError> {
    let WqWeight { q: weight, scales, mins } = weight;
    let layout = Layout::new(shape, weight)?;
    let WqShape { rows, out_features, in_features, .. } = shape;
    check_len("x", x.len(), rows * in_features)?;
    let weight_len = match weight {
        QWeight::Int4(q) => q.len(),
        QWeight::Int8(q) => q.len(),
    };
    check_len("qweight", weight_len, out_features * layout.row_bytes)?;
    check_len("scales", scales.len(), out_features * layout.groups)?;
    if let Some(mins) = mins {
        check_len("mins", mins.len(), out_features * layout.groups)?;
    }
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    check_len("out", out.len(), rows * out_features)?;
    let x = padded_rows(x, rows, in_features, layout.k_padded);
    let weights = Weights { q: weight, scales, mins, layout };
    if rows <= ROW_PATH_MAX_ROWS {
        weights.row_path(&x, rows, bias, out, threads);
    } else {
        let tiled = TiledShape { rows, out_features, k_padded: layout.k_padded };
        tiled_linear(&x, &weights, bias, out, tiled, threads);
    }
    Ok(())
}

/// `x`'s rows widened with zeros to `k_padded` columns (borrowed where they already are).
pub(crate) fn padded_rows(x: &[f32], rows: usize, k: usize, k_padded: usize) -> Cow<'_, [f32]> {
    if k == k_padded {
        return Cow::Borrowed(x);
    }
    let mut out = vec![0.0; rows * k_padded];
    for (dst, src) in out.chunks_exact_mut(k_padded).zip(x.chunks_exact(k.max(1))) {
        dst[..k].copy_from_slice(src);
    }
    Cow::Owned(out)
}

/// How a weight row's elements fall into groups and blocks.
#[derive(Clone, Copy, Debug)]
struct Layout {
    k: usize,
    /// `k` rounded up to whole 32-element blocks (x's padded width).
    k_padded: usize,
    group: usize,
    groups: usize,
    /// Bytes of one stored row.
    row_bytes: usize,
    /// Whole 32-element blocks the vector loops read (int8 rows stop at `k`; the rest of
    /// the row, its tail, goes element by element).
    blocks: usize,
}

impl Layout {
    fn new(shape: WqShape, weight: QWeight<'_>) -> Result<Self, KernelError> {
        let WqShape { in_features: k, group_size: group, .. } = shape;
        if k == 0 {
            return Err(KernelError::Value { name: "in_features", limit: "at least 1".into(), value: 0 });
        }
        if group == 0 || !k.is_multiple_of(group) {
            let limit = format!("a divisor of in_features ({k})");
            return Err(KernelError::Value { name: "group_size", limit, value: group as i64 });
        }
        if !(group == 16 || group.is_multiple_of(32) || group == k) {
            let limit = format!("16, a multiple of 32, or in_features ({k})");
            return Err(KernelError::Value { name: "group_size", limit, value: group as i64 });
        }
        let k_padded = k.div_ceil(K_STEP) * K_STEP;
        let (row_bytes, blocks) = match weight {
            QWeight::Int4(_) => (int4_row_bytes(k), k_padded / INT4_BLOCK),
            QWeight::Int8(_) => (k, k / INT4_BLOCK),
        };
        Ok(Layout { k, k_padded, group, groups: k / group, row_bytes, blocks })
    }
}

/// One call's weight, scales and mins.
struct Weights<'a> {
    q: QWeight<'a>,
    scales: &'a [f32],
    mins: Option<&'a [f32]>,
    layout: Layout,
}

impl Weights<'_> {
    /// `q[n, k]` as stored.
    #[inline(always)]
    fn q(&self, n: usize, k: usize) -> f32 {
        match self.q {
            QWeight::Int4(q) => {
                let (b, i) = (k / INT4_BLOCK, k % INT4_BLOCK);
                let byte = q[n * self.layout.row_bytes + b * 16 + i % 16];
                f32::from(if i < 16 { byte & 0x0f } else { byte >> 4 })
            }
            QWeight::Int8(q) => f32::from(q[n * self.layout.row_bytes + k]),
        }
    }

    /// `w[n, k] = q · scale + min`.
    #[inline(always)]
    fn value(&self, n: usize, k: usize) -> f32 {
        let g = n * self.layout.groups + k / self.layout.group;
        self.q(n, k) * self.scales[g] + self.mins.map_or(0.0, |m| m[g])
    }

    /// Rows of `x` (`k_padded` apart) by the weight, one weight row after another, split over
    /// the team by weight rows.
    fn row_path(&self, x: &[f32], rows: usize, bias: Option<&[f32]>, out: &mut [f32], threads: usize) {
        let Layout { k_padded, groups, .. } = self.layout;
        let out_features = out.len() / rows.max(1);
        let xsums: Vec<f32> = if self.mins.is_some() { self.group_sums(x, rows) } else { Vec::new() };
        let dst = openmp::SharedMut(out.as_mut_ptr());
        openmp::parallel(threads, |thread, team| {
            for n in openmp::share(out_features, thread, team) {
                let dots = if rows == 1 {
                    let xsum = self.mins.map(|_| &xsums[..groups]);
                    [self.row_dot(n, &x[..k_padded], xsum), 0.0]
                } else {
                    self.row_dot2(n, x, &xsums)
                };
                let b = bias.map_or(0.0, |b| b[n]);
                for (r, dot) in dots.iter().enumerate().take(rows) {
                    // SAFETY: each thread writes only its own weight rows' columns of `out`,
                    // which holds `rows * out_features` elements and outlives `parallel`.
                    unsafe { *dst.get().add(r * out_features + n) = dot + b };
                }
            }
        });
    }

    /// Sums of each row of `x` over each group, `[rows, groups]`: what the mins multiply.
    fn group_sums(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let Layout { k, k_padded, group, .. } = self.layout;
        (0..rows)
            .flat_map(|r| x[r * k_padded..r * k_padded + k].chunks_exact(group).map(|c| c.iter().sum()))
            .collect()
    }

    /// Weight row `n` dotted with one row of `x` (`k_padded` long); `xsum` its group sums
    /// where there are mins.
    fn row_dot(&self, n: usize, x: &[f32], xsum: Option<&[f32]>) -> f32 {
        if let Some([dot]) = self.vector_dot::<1>(n, x, x.len()) {
            return dot + self.mins_term(n, xsum.unwrap_or(&[]));
        }
        (0..self.layout.k).map(|k| self.value(n, k) * x[k]).sum()
    }

    /// [`Self::row_dot`] for two rows of `x` at once (each weight row read once).
    fn row_dot2(&self, n: usize, x: &[f32], xsums: &[f32]) -> [f32; 2] {
        let Layout { k_padded, groups, .. } = self.layout;
        if let Some(dots) = self.vector_dot::<2>(n, x, k_padded) {
            let xsum = |r: usize| xsums.get(r * groups..(r + 1) * groups).unwrap_or(&[]);
            return [dots[0] + self.mins_term(n, xsum(0)), dots[1] + self.mins_term(n, xsum(1))];
        }
        [0, 1].map(|r| (0..self.layout.k).map(|k| self.value(n, k) * x[r * k_padded + k]).sum())
    }

    /// Weight row `n` dotted with `M` rows of `x` (`stride` apart, each `k_padded` long) on the
    /// widest vectors this CPU has, scales applied and mins not; None on CPUs without AVX2.
    fn vector_dot<const M: usize>(&self, n: usize, x: &[f32], stride: usize) -> Option<[f32; M]> {
        #[cfg(target_arch = "x86_64")]
        {
            if simd::has_avx512f() && self.takes_avx512() {
                // SAFETY: the CPU has AVX-512F; `takes_avx512` holds.
                return Some(unsafe { self.row_dot_avx512::<M>(n, x, stride) });
            }
            if simd::has_avx2_fma() {
                return Some(self.row_dot_avx2::<M>(n, x, stride));
            }
        }
        let _ = (n, x, stride);
        None
    }

    /// Whether the AVX-512 loops take this layout: groups of 16 or 32, and int4 rows in groups
    /// of any multiple of 32 (with wider int8 groups AVX2's loop was as fast: see `avx512`).
    fn takes_avx512(&self) -> bool {
        let group = self.layout.group;
        matches!(group, 16 | INT4_BLOCK)
            || matches!(self.q, QWeight::Int4(_)) && group.is_multiple_of(INT4_BLOCK)
    }

    /// `Σ_g mins[n, g] · xsum[g]`, 0 without mins.
    fn mins_term(&self, n: usize, xsum: &[f32]) -> f32 {
        let groups = self.layout.groups;
        self.mins.map_or(0.0, |m| m[n * groups..(n + 1) * groups].iter().zip(xsum).map(|(a, b)| a * b).sum())
    }

    /// The products of row `n` past the vector loops' whole blocks (int8 rows whose length is
    /// not a multiple of 32), scaled but without mins (those go through the group sums).
    fn tail_dot(&self, n: usize, x: &[f32]) -> f32 {
        let Layout { k, blocks, groups, group, .. } = self.layout;
        (blocks * INT4_BLOCK..k).map(|k| self.q(n, k) * self.scales[n * groups + k / group] * x[k]).sum()
    }

    /// Row `n`'s dequantized columns `k0..k0 + dst.len()`, zeros past `in_features`.
    fn decode_row(&self, n: usize, k0: usize, dst: &mut [f32]) {
        let k_end = (k0 + dst.len()).min(self.layout.k);
        let mut done = k0;
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2_fma() {
            done = self.decode_row_avx2(n, k0, dst);
        }
        for k in done..k_end {
            dst[k - k0] = self.value(n, k);
        }
        dst[k_end.max(k0) - k0..].fill(0.0);
    }
}

impl Tiles for Weights<'_> {
    fn decode(&self, rows: Range<usize>, k0: usize, len: usize, dst: &mut [f32]) {
        for (n, row) in rows.zip(dst.chunks_exact_mut(len)) {
            self.decode_row(n, k0, row);
        }
    }
}

#[cfg(test)]
mod tests;
