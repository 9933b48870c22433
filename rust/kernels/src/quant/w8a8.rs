//! W8A8 int8 linear layers (compressed-tensors W8A8, vLLM's int8 CPU mode): int8 weights with a
//! scale per output feature, activations quantized to int8 inside the call, integer products.
//!
//! `out[r, n] = s_x[r] · s_w[n] · Σ_k (qx[r, k] - zp) · qw[n, k] + bias[n]`, where the
//! activations are quantized either per token, dynamically (`s_x[r] = max|x[r]| / 127`,
//! `qx = round(x / s_x)`, ties to even, clamped to [-128, 127], `zp = 0`: vLLM's
//! `scaled_int8_quant`), or per tensor with a given scale and zero point
//! (`qx = clamp(round(x / s) + zp, -128, 127)`).
//!
//! [`w8a8_pack`] lays the weight out once for the products: tiles of 16 output features, in
//! each tile groups of 4 consecutive `k` of all 16 features, 64 bytes (byte `4 i + c` is feature
//! `i`'s `k = 4 j + c`), the shape VNNI's `vpdpbusd` multiplies against 4 broadcast activation
//! bytes; after the tiles, each feature's `Σ_k qw` as i32, for the unsigned activations VNNI
//! takes (`qx + 128`, corrected by `(128 + zp) · Σ_k qw`). Three kernels read it:
//!
//! - AVX512-VNNI / AVX-VNNI (`vpdpbusd`, selected at run time where the CPU has it): u8 × s8
//!   products summed in 32 bits, so nothing saturates;
//! - AVX2: `vpmaddubsw` would saturate its 16-bit pair sums for unsigned × signed bytes (255 ×
//!   -128 × 2), so activations are widened to i16 (`qx - zp`) and weights to i16 as they are
//!   loaded, and `vpmaddwd` multiplies: exact for every input, 16 products per instruction;
//! - a portable loop in i32.
//!
//! Costs: one pass over `x` to quantize it (rows × in bytes, twice that for AVX2; the rows split
//! over the team), then the weight is read once per call; a thread claims pairs of tiles and
//! runs every row block over each pair while it (32 × in bytes) stays in L2. With AVX512-VNNI
//! and more than three rows a pair is one register tile of 6 rows × 32 features; otherwise each
//! tile goes alone, 3 rows at a time.

mod act;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

use act::Activations;

use crate::error::{check_len, KernelError};
use crate::openmp;

/// Output features per tile of the packed weight.
pub const TILE: usize = 16;
/// Consecutive `k` of one feature side by side in a tile.
const QUAD: usize = 4;

/// `x` is `[rows, in_features]`, `out` `[rows, out_features]`; the weight `[out_features,
/// in_features]` before packing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct W8a8Shape {
    pub rows: usize,
    pub out_features: usize,
    pub in_features: usize,
}

/// How the activations are quantized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ActQuant {
    /// Per token: `s = max|x[r]| / 127`, symmetric.
    Dynamic,
    /// Per tensor, given: `qx = clamp(round(x / scale) + zero_point, -128, 127)`.
    Static { scale: f32, zero_point: i32 },
}

/// `in_features` rounded up to whole quads.
fn k_padded(in_features: usize) -> usize {
    in_features.div_ceil(QUAD) * QUAD
}

/// Bytes [`w8a8_pack`] writes for an `[out_features, in_features]` weight: the tiles, then
/// 4 bytes of weight sum per (padded) feature.
pub fn w8a8_packed_len(out_features: usize, in_features: usize) -> usize {
    let features = out_features.div_ceil(TILE) * TILE;
    features * k_padded(in_features) + 4 * features
}

/// Packs `qweight` (`[out_features, in_features]`, row-major) into `packed`
/// ([`w8a8_packed_len`] bytes) for [`w8a8_linear`]; tiles split over the team.
pub fn w8a8_pack(
    qweight: &[i8],
    packed: &mut [u8],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    check_len("qweight", qweight.len(), out_features * in_features)?;
    check_len("packed", packed.len(), w8a8_packed_len(out_features, in_features))?;
    let kp = k_padded(in_features);
    let (tiles, sums) = packed.split_at_mut(out_features.div_ceil(TILE) * TILE * kp);
    let at = |n: usize, k: usize| {
        if n < out_features && k < in_features {
            qweight[n * in_features + k]
        } else {
            0
        }
    };
    openmp::for_each_share_pair(tiles, sums, TILE * kp, 4 * TILE, 4, threads, |units, tiles, sums| {
        for (t, (tile, sums)) in
            units.zip(tiles.chunks_exact_mut(TILE * kp).zip(sums.chunks_exact_mut(4 * TILE)))
        {
            for (j, quad) in tile.chunks_exact_mut(TILE * QUAD).enumerate() {
                for (b, byte) in quad.iter_mut().enumerate() {
                    *byte = at(t * TILE + b / QUAD, j * QUAD + b % QUAD) as u8;
                }
            }
            for (i, sum) in sums.chunks_exact_mut(4).enumerate() {
                let total: i32 = (0..in_features).map(|k| i32::from(at(t * TILE + i, k))).sum();
                sum.copy_from_slice(&total.to_le_bytes());
            }
        }
    });
    Ok(())
}

/// A W8A8 weight: [`w8a8_pack`]'s bytes and the scale of each output feature.
#[derive(Clone, Copy, Debug)]
pub struct W8a8Weight<'a> {
    pub packed: &'a [u8],
    pub weight_scale: &'a [f32],
}

/// `out = dequant(quant(x) · qwᵀ) + bias` (see the module doc) on up to `threads` threads of
/// the OpenMP team; `weight_scale` is `[out_features]`.
pub fn w8a8_linear(
    x: &[f32],
    weight: W8a8Weight<'_>,
    bias: Option<&[f32]>,
    act: ActQuant,
    out: &mut [f32],
    shape: W8a8Shape,
    threads: usize,
) -> Result<(), KernelError> {
    let W8a8Shape { rows, out_features, in_features } = shape;
    let W8a8Weight { packed, weight_scale } = weight;
    check_len("x", x.len(), rows * in_features)?;
    check_len("packed", packed.len(), w8a8_packed_len(out_features, in_features))?;
    check_len("weight_scale", weight_scale.len(), out_features)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    check_len("out", out.len(), rows * out_features)?;
    if let ActQuant::Static { scale, zero_point } = act {
        if !(scale.is_finite() && scale > 0.0) {
            let (limit, value) = ("finite and > 0".into(), scale.to_string());
            return Err(KernelError::Param { name: "input_scale", limit, value });
        }
        if !(-128..=127).contains(&zero_point) {
            let limit = "between -128 and 127".into();
            return Err(KernelError::Value { name: "input_zero_point", limit, value: zero_point.into() });
        }
    }
    run(x, weight, bias, act, out, shape, threads, Kernel::detect());
    Ok(())
}

/// [`w8a8_linear`] on checked arguments, with `kernel`.
#[allow(clippy::too_many_arguments)]
fn run(
    x: &[f32],
    weight: W8a8Weight<'_>,
    bias: Option<&[f32]>,
    act: ActQuant,
    out: &mut [f32],
    shape: W8a8Shape,
    threads: usize,
    kernel: Kernel,
) {
    let W8a8Shape { rows, out_features, in_features } = shape;
    let W8a8Weight { packed, weight_scale } = weight;
    let acts = Activations::quantize(x, rows, in_features, act, kernel, threads);
    let tiles = out_features.div_ceil(TILE);
    let kp = k_padded(in_features);
    let (weights, sums) = packed.split_at(tiles * TILE * kp);
    let job = Job { acts: &acts, weights, sums, weight_scale, bias, shape, kernel };
    let dst = openmp::SharedMut(out.as_mut_ptr());
    // Claimed rather than split in fixed shares: a thread slowed from outside takes fewer tiles.
    // A claim is the tiles one kernel call multiplies: a pair for the AVX-512 two-tile kernel,
    // else one (a decode step's threads then finish at most a tile apart).
    let per_claim = if job.pairs() { 2 } else { 1 };
    let units = tiles.div_ceil(per_claim);
    let team = threads.min(units).max(1);
    let claims = openmp::Claims::new(units, team);
    openmp::parallel(team, |thread, _| {
        while let Some(unit) = claims.take(thread) {
            let first = unit * per_claim;
            // SAFETY: each unit goes to one thread, which alone writes its columns of `out`;
            // `out` holds `rows * out_features` elements and outlives `parallel`.
            unsafe { job.tiles(first..tiles.min(first + per_claim), dst.get()) };
        }
    });
}

/// Which integer product runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Avx512Vnni,
    AvxVnni,
    Avx2,
    Portable,
}

impl Kernel {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if x86::has_avx512_vnni() {
                return Kernel::Avx512Vnni;
            }
            if x86::has_avx_vnni() {
                return Kernel::AvxVnni;
            }
            if crate::simd::has_avx2_fma() {
                return Kernel::Avx2;
            }
        }
        Kernel::Portable
    }

    /// Whether the kernel takes activations as unsigned bytes `qx + 128` (else i16 `qx - zp`).
    fn unsigned(self) -> bool {
        matches!(self, Kernel::Avx512Vnni | Kernel::AvxVnni)
    }
}

/// One call's operands, shared by the team.
struct Job<'a> {
    acts: &'a Activations,
    weights: &'a [u8],
    sums: &'a [u8],
    weight_scale: &'a [f32],
    bias: Option<&'a [f32]>,
    shape: W8a8Shape,
    kernel: Kernel,
}

/// Rows of activations per micro-kernel call.
const ROW_BLOCK: usize = 3;
/// Output features of the AVX-512 two-tile kernel, and its most rows per call.
const PAIR: usize = 2 * TILE;
const PAIR_ROWS: usize = 6;

impl Job<'_> {
    /// Every row's outputs for the features of `tiles` (one or two consecutive tiles).
    ///
    /// # Safety
    /// `out` addresses `rows * out_features` elements, of which no other thread writes these
    /// tiles' columns.
    unsafe fn tiles(&self, tiles: std::ops::Range<usize>, out: *mut f32) {
        #[cfg(target_arch = "x86_64")]
        if self.pairs() && tiles.len() == 2 {
            return self.pair(tiles.start, out);
        }
        for tile in tiles {
            self.tile(tile, out);
        }
    }

    /// Whether tiles go in pairs through the AVX-512 two-tile kernel: with AVX512-VNNI and more
    /// rows than one call of the one-tile kernel takes.
    fn pairs(&self) -> bool {
        self.kernel == Kernel::Avx512Vnni && self.shape.rows > ROW_BLOCK
    }

    /// Every row's outputs for tile `tile`'s features.
    ///
    /// # Safety
    /// As [`Job::tiles`].
    unsafe fn tile(&self, tile: usize, out: *mut f32) {
        let kp = self.acts.kp;
        let weights = &self.weights[tile * TILE * kp..(tile + 1) * TILE * kp];
        let sums = self.weight_sums(tile);
        for r0 in (0..self.shape.rows).step_by(ROW_BLOCK) {
            let rows = ROW_BLOCK.min(self.shape.rows - r0);
            let mut acc = [[0i32; TILE]; ROW_BLOCK];
            self.products(weights, r0, rows, &mut acc);
            for (r, acc) in acc.iter().enumerate().take(rows) {
                self.write_row(r0 + r, tile, acc, &sums, out);
            }
        }
    }

    /// [`Job::tile`] for tiles `first` and `first + 1` at once, [`PAIR_ROWS`] rows per call of
    /// the AVX-512 VNNI two-tile kernel.
    ///
    /// # Safety
    /// As [`Job::tiles`]; the CPU has AVX512-VNNI.
    #[cfg(target_arch = "x86_64")]
    unsafe fn pair(&self, first: usize, out: *mut f32) {
        let kp = self.acts.kp;
        let W8a8Shape { rows, out_features, .. } = self.shape;
        let weights = &self.weights[first * TILE * kp..(first + 2) * TILE * kp];
        let tile_out = |tile: usize| {
            let features = (tile * TILE).min(out_features)..((tile + 1) * TILE).min(out_features);
            let bias = self.bias.map(|b| &b[features.clone()]);
            x86::TileOut { sums: self.weight_sums(tile), scale: &self.weight_scale[features], bias }
        };
        let tiles = [tile_out(first), tile_out(first + 1)];
        let mut o = x86::PairOut { tiles, offset: self.acts.offset, s_x: &[], out, stride: out_features };
        // SAFETY (the calls below): the caller's CPU has AVX512-VNNI (so AVX512F); the rows
        // `r0..r0 + block` hold `kp` bytes each, `weights` two tiles, and `o.out` this block's
        // rows of the pair's columns, which only this thread writes.
        for r0 in (0..rows).step_by(PAIR_ROWS) {
            let block = PAIR_ROWS.min(rows - r0);
            let mut acc = [[0i32; PAIR]; PAIR_ROWS];
            x86::vnni512_pair(&self.acts.bytes[r0 * kp..], kp, weights, block, &mut acc);
            o.s_x = &self.acts.scales[r0..r0 + block];
            o.out = out.add(r0 * out_features + first * TILE);
            x86::scale_pair_rows(&acc, &o);
        }
    }

    /// Each of tile `tile`'s features' `Σ_k qw`.
    fn weight_sums(&self, tile: usize) -> [i32; TILE] {
        let mut sums = [0i32; TILE];
        for (i, s) in sums.iter_mut().enumerate() {
            let at = 4 * (tile * TILE + i);
            *s = i32::from_le_bytes(self.sums[at..at + 4].try_into().expect("four bytes"));
        }
        sums
    }

    /// `acc[r][i] = Σ_k a[r0 + r, k] · qw[tile feature i, k]` in the kernel's activation form.
    fn products(&self, weights: &[u8], r0: usize, rows: usize, acc: &mut [[i32; TILE]; ROW_BLOCK]) {
        let kp = self.acts.kp;
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: `detect` chose the kernel for this CPU; the activation rows `r0..r0 + rows`
            // hold `kp` elements each and `weights` one tile of `kp` quads.
            match self.kernel {
                Kernel::Avx512Vnni => {
                    return unsafe { x86::vnni512(&self.acts.bytes[r0 * kp..], kp, weights, rows, acc) }
                }
                Kernel::AvxVnni => {
                    return unsafe { x86::vnni256(&self.acts.bytes[r0 * kp..], kp, weights, rows, acc) }
                }
                Kernel::Avx2 => {
                    return unsafe { x86::madd16(&self.acts.wide[r0 * kp..], kp, weights, rows, acc) }
                }
                Kernel::Portable => {}
            }
        }
        portable(&self.acts.wide[r0 * kp..], kp, weights, rows, acc);
    }

    /// Scales row `r`'s products into `out` (only the real features of the tile).
    unsafe fn write_row(&self, r: usize, tile: usize, acc: &[i32; TILE], sums: &[i32; TILE], out: *mut f32) {
        let W8a8Shape { out_features, .. } = self.shape;
        let s_x = self.acts.scales[r];
        for i in 0..TILE.min(out_features - tile * TILE) {
            let n = tile * TILE + i;
            let dot = acc[i] - self.acts.offset * sums[i];
            let value = s_x * self.weight_scale[n] * dot as f32 + self.bias.map_or(0.0, |b| b[n]);
            *out.add(r * out_features + n) = value;
        }
    }
}

/// The reference product on i16 activations.
fn portable(acts: &[i16], kp: usize, weights: &[u8], rows: usize, acc: &mut [[i32; TILE]; ROW_BLOCK]) {
    for (r, acc) in acc.iter_mut().enumerate().take(rows) {
        let a = &acts[r * kp..(r + 1) * kp];
        for (j, quad) in weights.chunks_exact(TILE * QUAD).enumerate() {
            for (b, &w) in quad.iter().enumerate() {
                acc[b / QUAD] += i32::from(a[j * QUAD + b % QUAD]) * i32::from(w as i8);
            }
        }
    }
}
