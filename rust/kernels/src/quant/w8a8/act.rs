//! W8A8 activations quantized to int8 inside the call (see the parent module's doc): per
//! token and dynamic, or per tensor with a given scale and zero point, as the kernel that
//! multiplies them takes them.

#[cfg(target_arch = "x86_64")]
use super::x86;
use super::{k_padded, ActQuant, Kernel};
use crate::openmp;

/// One call's quantized activations: `[rows, k_padded]`, zero-padded, as `u8` (`qx + 128`) or
/// `i16` (`qx - zp`) as the kernel takes them, with each row's scale.
pub(super) struct Activations {
    pub(super) bytes: Vec<u8>,
    pub(super) wide: Vec<i16>,
    pub(super) scales: Vec<f32>,
    /// What each weight sum is multiplied by and taken off: `128 + zp` for bytes, else 0.
    pub(super) offset: i32,
    pub(super) kp: usize,
}

impl Activations {
    /// Quantizes `x`'s rows, split over the team: a prompt's rows (thousands) took as long as
    /// the products of a narrow projection on one thread.
    pub(super) fn quantize(
        x: &[f32],
        rows: usize,
        k: usize,
        act: ActQuant,
        kernel: Kernel,
        threads: usize,
    ) -> Self {
        let kp = k_padded(k);
        let zp = match act {
            ActQuant::Dynamic => 0,
            ActQuant::Static { zero_point, .. } => zero_point,
        };
        let mut acts =
            Activations { bytes: Vec::new(), wide: Vec::new(), scales: vec![0.0; rows], offset: 0, kp };
        let scale_of = |row: &[f32]| match act {
            ActQuant::Dynamic => max_abs(row) / 127.0,
            ActQuant::Static { scale, .. } => scale,
        };
        let row_and_scale = |r: usize| {
            let row = &x[r * k..(r + 1) * k];
            (row, scale_of(row))
        };
        if kernel.unsigned() {
            acts.bytes = vec![0; rows * kp];
            acts.offset = 128 + zp;
            each_row(&mut acts.bytes, &mut acts.scales, (k, kp), threads, |r, q, out| {
                let (row, scale) = row_and_scale(r);
                quantize_row_u8(row, scale, zp, q, &mut out[..k]);
                scale
            });
        } else {
            acts.wide = vec![0; rows * kp];
            each_row(&mut acts.wide, &mut acts.scales, (k, kp), threads, |r, q, out| {
                let (row, scale) = row_and_scale(r);
                quantize_row(row, scale, zp, q);
                for (w, v) in out[..k].iter_mut().zip(q.iter()) {
                    *w = (v - zp) as i16;
                }
                scale
            });
        }
        acts
    }
}

/// Fewer rows per thread than this are quantized on the calling thread alone.
const MIN_QUANTIZE_ROWS: usize = 8;

/// Calls `put(r, scratch, out_row)` for every row `r` of `out` (rows of `kp`; `(k, kp)` the row's
/// values and its padded width), each thread for its share of the rows with a scratch of `k`
/// integers; `put` returns the row's scale, which goes to `scales[r]`.
fn each_row<E: Send>(
    out: &mut [E],
    scales: &mut [f32],
    (k, kp): (usize, usize),
    threads: usize,
    put: impl Fn(usize, &mut [i32], &mut [E]) -> f32 + Sync,
) {
    openmp::for_each_share_pair(out, scales, kp, 1, MIN_QUANTIZE_ROWS, threads, |units, out, scales| {
        let mut q = vec![0i32; k];
        for ((r, out), scale) in units.zip(out.chunks_exact_mut(kp)).zip(scales) {
            *scale = put(r, &mut q, out);
        }
    });
}

/// `max |row|`, NaN ignored (as `f32::max` does).
pub(super) fn max_abs(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512f() {
        // SAFETY: the CPU has AVX512F.
        return unsafe { x86::max_abs(row) };
    }
    row.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// [`quantize_row`] as the unsigned bytes `q + 128` the VNNI kernels take; `q` is scratch.
pub(super) fn quantize_row_u8(row: &[f32], scale: f32, zp: i32, q: &mut [i32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx512f() && scale > 0.0 {
        // SAFETY: the CPU has AVX512F; `out` is as long as `row`.
        return unsafe { x86::quantize_row_u8(row, scale, zp, out) };
    }
    quantize_row(row, scale, zp, q);
    for (b, v) in out.iter_mut().zip(q.iter()) {
        *b = (v + 128) as u8;
    }
}

/// `q = clamp(round_ties_even(x / scale) + zp, -128, 127)`; all zeros where `scale` is 0 (a
/// row of zeros under dynamic quantization).
pub(super) fn quantize_row(row: &[f32], scale: f32, zp: i32, q: &mut [i32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && scale > 0.0 {
        // SAFETY: the CPU has AVX2; `q` is as long as `row`.
        return unsafe { x86::quantize_row(row, scale, zp, q) };
    }
    for (q, v) in q.iter_mut().zip(row) {
        let r = if scale > 0.0 { (v / scale).round_ties_even() } else { 0.0 };
        // `as` saturates (NaN to 0), and the clamp keeps the int8 range.
        *q = ((r as i32).saturating_add(if scale > 0.0 { zp } else { 0 })).clamp(-128, 127);
    }
}
