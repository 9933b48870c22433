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
            // Groups of 16 or 32 only: with wider ones AVX2's loop was as fast (see `avx512`).
            if simd::has_avx512f() && matches!(self.layout.group, 16 | INT4_BLOCK) {
                // SAFETY: the CPU has AVX-512F; the groups are 16 or 32 (multiples of 16).
                return Some(unsafe { self.row_dot_avx512::<M>(n, x, stride) });
            }
            if simd::has_avx2_fma() {
                return Some(self.row_dot_avx2::<M>(n, x, stride));
            }
        }
        let _ = (n, x, stride);
        None
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
mod tests {
    use super::*;
    use crate::test_support::{assert_near, linear, values};

    /// Random stored values of `bits` for an `[n, k]` weight, their scales and mins.
    struct Case {
        q: Vec<u8>,
        scales: Vec<f32>,
        mins: Vec<f32>,
    }

    fn case(bits: u32, n: usize, k: usize, group: usize, seed: u32) -> Case {
        let levels = 1u32 << bits;
        let q = (0..n * k).map(|i| ((i as u32).wrapping_mul(2_654_435_761).rotate_right(7) + seed) % levels);
        let q = q.map(|v| if bits == 8 { (v as i32 - 128) as i8 as u8 } else { v as u8 }).collect();
        let groups = n * k / group;
        let scales = values(groups, seed + 1).iter().map(|s| 0.01 + s.abs() * 0.1).collect();
        Case { q, scales, mins: values(groups, seed + 2) }
    }

    /// The dequantized weight, in f32 as the format defines it.
    fn dense(c: &Case, bits: u32, n: usize, k: usize, group: usize, mins: bool) -> Vec<f32> {
        (0..n * k)
            .map(|i| {
                let q = if bits == 8 { f32::from(c.q[i] as i8) } else { f32::from(c.q[i]) };
                let g = (i / k) * (k / group) + (i % k) / group;
                q * c.scales[g] + if mins { c.mins[g] } else { 0.0 }
            })
            .collect()
    }

    fn run(c: &Case, bits: u32, shape: WqShape, x: &[f32], mins: bool, bias: Option<&[f32]>) -> Vec<f32> {
        let WqShape { rows, out_features: n, in_features: k, .. } = shape;
        let mut packed = vec![0u8; int4_packed_len(n, k)];
        let weight = if bits == 4 {
            pack_int4(&c.q, &mut packed, n, k, 2).unwrap();
            QWeight::Int4(&packed)
        } else {
            // SAFETY: `u8` and `i8` have the same size and alignment.
            QWeight::Int8(unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) })
        };
        let mut out = vec![f32::NAN; rows * n];
        let mins = mins.then_some(c.mins.as_slice());
        let weight = WqWeight { q: weight, scales: &c.scales, mins };
        wq_linear(x, weight, bias, &mut out, shape, 2).unwrap();
        out
    }

    #[test]
    fn matches_dequantize_then_matmul_for_every_layout() {
        // Per group sizes 16 (odd and even counts of groups), 32 to 256, and per channel with
        // in_features not a multiple of 32 (int8 rows then end in a tail).
        let layouts = [(64, 16), (48, 16), (96, 32), (128, 64), (384, 128), (512, 256), (37, 37), (160, 160)];
        for bits in [4, 8] {
            for (k, group) in layouts {
                for (rows, n) in [(1, 13), (2, 37), (3, 5), (7, 12), (33, 25)] {
                    let shape = WqShape { rows, out_features: n, in_features: k, group_size: group };
                    let c = case(bits, n, k, group, (k + rows) as u32);
                    let (x, b) = (values(rows * k, 9), values(n, 10));
                    for (mins, bias) in [(false, None), (true, Some(b.as_slice()))] {
                        let want = linear(&x, &dense(&c, bits, n, k, group, mins), bias, rows, n, k);
                        let got = run(&c, bits, shape, &x, mins, bias);
                        let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                        let what = format!("bits {bits} {shape:?} mins {mins}");
                        let (got, want): (Vec<_>, Vec<_>) =
                            got.iter().zip(&want).map(|(g, w)| (g / scale, w / scale)).unzip();
                        assert_near(&got, &want, &what);
                    }
                }
            }
        }
    }

    #[test]
    fn the_scalar_formula_agrees_with_the_vector_loops() {
        let (n, k, group) = (5, 96, 32);
        for bits in [4, 8] {
            let c = case(bits, n, k, group, 3);
            let mut packed = vec![0u8; int4_packed_len(n, k)];
            pack_int4(&c.q.iter().map(|v| v & 15).collect::<Vec<_>>(), &mut packed, n, k, 1).unwrap();
            // SAFETY: as in `run`.
            let q8 = unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) };
            let q = if bits == 4 { QWeight::Int4(&packed) } else { QWeight::Int8(q8) };
            let shape = WqShape { rows: 1, out_features: n, in_features: k, group_size: group };
            let layout = Layout::new(shape, q).unwrap();
            let w = Weights { q, scales: &c.scales, mins: Some(&c.mins), layout };
            let mut row = vec![0.0; k];
            w.decode_row(2, 0, &mut row);
            let scalar: Vec<f32> = (0..k).map(|i| w.value(2, i)).collect();
            assert_near(&row, &scalar, "decoded row");
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn each_vector_path_here_agrees_with_the_scalar_formula() {
        // Group 16 (its own loop), per group, per channel with an int8 tail; one and two rows.
        for (k, group) in [(80, 16), (48, 16), (96, 32), (256, 128), (20, 20), (37, 37), (160, 160)] {
            for bits in [4, 8] {
                let n = 3;
                let c = case(bits, n, k, group, k as u32);
                let mut packed = vec![0u8; int4_packed_len(n, k)];
                if bits == 4 {
                    pack_int4(&c.q, &mut packed, n, k, 1).unwrap();
                }
                // SAFETY: as in `run`.
                let q8 = unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) };
                let q = if bits == 4 { QWeight::Int4(&packed) } else { QWeight::Int8(q8) };
                let shape = WqShape { rows: 2, out_features: n, in_features: k, group_size: group };
                let layout = Layout::new(shape, q).unwrap();
                let w = Weights { q, scales: &c.scales, mins: None, layout };
                let mut x = values(2 * layout.k_padded, 4);
                for r in 0..2 {
                    x[r * layout.k_padded + k..(r + 1) * layout.k_padded].fill(0.0);
                }
                let scalar =
                    |r: usize| (0..k).map(|i| w.value(1, i) * x[r * layout.k_padded + i]).sum::<f32>();
                let want = [scalar(0), scalar(1)];
                let mut paths = Vec::new();
                if simd::has_avx2_fma() {
                    paths.push(("avx2", w.row_dot_avx2::<2>(1, &x, layout.k_padded)));
                }
                if simd::has_avx512f() && matches!(group, 16 | INT4_BLOCK) {
                    // SAFETY: the CPU has AVX-512F; the groups are 16 or 32.
                    paths.push(("avx512", unsafe { w.row_dot_avx512::<2>(1, &x, layout.k_padded) }));
                    let [one] = unsafe { w.row_dot_avx512::<1>(1, &x, layout.k_padded) };
                    paths.push(("avx512 one row", [one, want[1]]));
                }
                for (path, got) in paths {
                    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                    let norm = |v: [f32; 2]| v.map(|e| e / scale);
                    assert_near(&norm(got), &norm(want), &format!("{path} bits {bits} k {k} group {group}"));
                }
            }
        }
    }

    #[test]
    fn refuses_layouts_and_values_it_cannot_take() {
        let shape = WqShape { rows: 1, out_features: 2, in_features: 96, group_size: 48 };
        let (x, s, q) = (vec![0.0; 96], vec![0.0; 4], vec![0i8; 192]);
        let w = WqWeight { q: QWeight::Int8(&q), scales: &s, mins: None };
        let mut out = vec![0.0; 2];
        let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
        assert!(
            err.to_string()
                .contains("`group_size` must be 16, a multiple of 32, or in_features (96). Given: 48"),
            "{err}"
        );
        let shape = WqShape { group_size: 40, ..shape };
        let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
        assert!(err.to_string().contains("a divisor of in_features (96). Given: 40"), "{err}");
        let shape = WqShape { group_size: 32, ..shape };
        let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "scales", expected: 6, actual: 4 });
        let err = pack_int4(&[1, 16, 3], &mut [0u8; 16], 1, 3, 1).unwrap_err();
        assert!(err.to_string().contains("`q` must be between 0 and 15. Given: 16"), "{err}");
    }

    #[test]
    fn int4_rows_pack_into_padded_blocks() {
        let q: Vec<u8> = (0..40).map(|i| (i % 16) as u8).collect();
        let mut packed = vec![0xffu8; int4_packed_len(1, 40)];
        pack_int4(&q, &mut packed, 1, 40, 1).unwrap();
        assert_eq!(packed.len(), 32);
        assert_eq!(packed[0], q[0] | (q[16] << 4));
        assert_eq!(packed[16 + 7], q[39]);
        assert_eq!(packed[16 + 8..], [0; 8]);
    }
}
