//! FP8 (e4m3fn) linear layers: `fp8` checkpoints (per-tensor `weight_scale`, DeepSeek-style
//! block `weight_scale_inv`), compressed-tensors FP8 W8A8, and vLLM's dynamic `quantization="fp8"`.
//!
//! `out[r, n] = Σ_k xq[r, k] · e4m3(w[n, k]) · s_w(n, k) + bias[n]`, where the weight scale
//! is one per tensor, per output feature, or per `(bo, bi)` block, and `xq` is `x` itself
//! (weight-only) or `x` quantized to e4m3 and back in f32 (`e4m3(x / s) · s`, saturating at
//! ±448, ties to even): per tensor with `s = max|x| / 448` (vLLM's dynamic fp8), a given
//! static `s`, or per token per `bi` columns (block weights, as vLLM quantizes their inputs).
//! Every e4m3 value and every product of two is exact in f32, so this is the quantized
//! operands' product, rounded as an f32 GEMM rounds.
//!
//! CPUs without fp8 units decode the weight in registers: the byte's magnitude shifted into an
//! IEEE half's exponent and mantissa (the two formats share the mantissa's top bits, and the
//! half's wider exponent keeps e4m3's subnormals normal or subnormal exactly), converted by
//! F16C eight lanes at a time, times 2^8 (folded into the scale) to undo the exponent bias
//! difference; the NaN encodings (`0x7f`, `0xff`) are patched to a half NaN. One or two rows
//! stream the weight once, summing per scale group; more go through `super::tiled`.

#[cfg(target_arch = "x86_64")]
mod avx2;

use std::ops::Range;

use super::tiled::{tiled_linear, TiledShape, Tiles, K_STEP};
use super::wq::{padded_rows, ROW_PATH_MAX_ROWS};
use crate::error::{check_len, KernelError};
use crate::openmp;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// How the weight is scaled.
#[derive(Clone, Copy, Debug)]
pub enum Fp8Scale<'a> {
    /// One scale.
    Tensor(f32),
    /// `[out_features]`.
    Channel(&'a [f32]),
    /// `[ceil(out / bo), ceil(in / bi)]` for blocks of `bo` features × `bi` inputs.
    Block { scales: &'a [f32], bo: usize, bi: usize },
}

/// How the activations are quantized (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fp8Input {
    None,
    Tensor,
    Static(f32),
    Group,
}

/// `x` is `[rows, in_features]`, the weight `[out_features, in_features]` e4m3 bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fp8Shape {
    pub rows: usize,
    pub out_features: usize,
    pub in_features: usize,
}

/// An e4m3fn byte's value: exact, NaN for `0x7f` and `0xff`.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    let (exp, mantissa) = (i32::from((b >> 3) & 0x0f), f32::from(b & 7));
    let magnitude = match (exp, b & 0x7f) {
        (_, 0x7f) => f32::NAN,
        (0, _) => mantissa * 2f32.powi(-9),
        _ => (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7),
    };
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// `v` rounded to the nearest e4m3 value (ties to even), saturating at ±448; NaN stays NaN.
#[inline(always)]
pub fn round_to_e4m3(v: f32) -> f32 {
    let a = v.abs().min(E4M3_MAX);
    // The spacing of e4m3 values around `a`: 2^(e - 3), and 2^-9 among the subnormals.
    let exp = ((a.to_bits() >> 23) as i32 - 127).max(-6);
    let step = f32::from_bits(((exp - 3 + 127) as u32) << 23);
    ((a / step).round_ties_even() * step).copysign(v)
}

/// An fp8 weight: `[out_features, in_features]` e4m3fn bytes and their scales.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Weight<'a> {
    pub bytes: &'a [u8],
    pub scale: Fp8Scale<'a>,
}

/// `out = xq · wᵀ + bias` (see the module doc) on up to `threads` threads of the OpenMP team.
pub fn fp8_linear(
    x: &[f32],
    weight: Fp8Weight<'_>,
    bias: Option<&[f32]>,
    input: Fp8Input,
    out: &mut [f32],
    shape: Fp8Shape,
    threads: usize,
) -> Result<(), KernelError> {
    let Fp8Shape { rows, out_features, in_features: k } = shape;
    let Fp8Weight { bytes: weight, scale } = weight;
    check_len("x", x.len(), rows * k)?;
    check_len("weight", weight.len(), out_features * k)?;
    let layout = Layout::new(scale, shape)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    check_len("out", out.len(), rows * out_features)?;
    if input == Fp8Input::Group && !matches!(scale, Fp8Scale::Block { .. }) {
        let limit =
            "\"none\", \"tensor\" or \"static\" without block scales (\"group\" needs block_size)".into();
        let value = "\"group\"".into();
        return Err(KernelError::Param { name: "input_quant", limit, value });
    }
    if let Fp8Input::Static(s) = input {
        if !(s.is_finite() && s > 0.0) {
            let (limit, value) = ("finite and > 0".into(), s.to_string());
            return Err(KernelError::Param { name: "input_scale", limit, value });
        }
    }
    let k_padded = k.div_ceil(K_STEP) * K_STEP;
    let mut xq = padded_rows(x, rows, k, k_padded).into_owned();
    quantize_input(&mut xq, rows, k_padded, k, input, layout.group);
    let weights = Weights { bytes: weight, layout };
    if rows <= ROW_PATH_MAX_ROWS {
        weights.row_path(&xq, rows, bias, out, threads);
    } else {
        tiled_linear(&xq, &weights, bias, out, TiledShape { rows, out_features, k_padded }, threads);
    }
    Ok(())
}

/// Replaces each row of `x` (`[rows, k_padded]`, `k` real columns) by its e4m3 quantization,
/// dequantized.
fn quantize_input(x: &mut [f32], rows: usize, k_padded: usize, k: usize, input: Fp8Input, group: usize) {
    let amax = |v: &[f32]| v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let apply = |v: &mut [f32], s: f32| {
        for e in v.iter_mut() {
            *e = if s > 0.0 { round_to_e4m3(*e / s) * s } else { 0.0 };
        }
    };
    match input {
        Fp8Input::None => {}
        Fp8Input::Static(s) => x.iter_mut().for_each(|e| *e = round_to_e4m3(*e / s) * s),
        Fp8Input::Tensor => {
            let s = amax(x) / E4M3_MAX;
            apply(x, s);
        }
        Fp8Input::Group => {
            for row in x.chunks_exact_mut(k_padded).take(rows) {
                for piece in row[..k].chunks_mut(group) {
                    let s = amax(piece) / E4M3_MAX;
                    apply(piece, s);
                }
            }
        }
    }
}

/// How a weight row's scales fall along `k`.
#[derive(Clone, Copy, Debug)]
struct Layout<'a> {
    scale: Fp8Scale<'a>,
    k: usize,
    /// Inputs per scale along a row (all of them but for blocks).
    group: usize,
    groups: usize,
}

impl<'a> Layout<'a> {
    fn new(scale: Fp8Scale<'a>, shape: Fp8Shape) -> Result<Self, KernelError> {
        let Fp8Shape { out_features, in_features: k, .. } = shape;
        let (group, groups) = match scale {
            Fp8Scale::Tensor(_) => (k.max(1), 1),
            Fp8Scale::Channel(s) => {
                check_len("weight_scale", s.len(), out_features)?;
                (k.max(1), 1)
            }
            Fp8Scale::Block { scales, bo, bi } => {
                if bo == 0 || bi == 0 || !bi.is_multiple_of(16) {
                    let limit = "block_size (bo, bi) with bo >= 1 and bi a multiple of 16".into();
                    return Err(KernelError::Param {
                        name: "block_size",
                        limit,
                        value: format!("({bo}, {bi})"),
                    });
                }
                check_len("weight_scale", scales.len(), out_features.div_ceil(bo) * k.div_ceil(bi))?;
                (bi, k.div_ceil(bi))
            }
        };
        Ok(Layout { scale, k, group, groups })
    }

    /// Row `n`'s scales, one per group of [`Self::group`] inputs.
    fn row_scales(&self, n: usize) -> &[f32] {
        match &self.scale {
            Fp8Scale::Tensor(s) => std::slice::from_ref(s),
            Fp8Scale::Channel(s) => &s[n..n + 1],
            Fp8Scale::Block { scales, bo, .. } => &scales[n / bo * self.groups..(n / bo + 1) * self.groups],
        }
    }
}

/// One call's weight.
struct Weights<'a> {
    bytes: &'a [u8],
    layout: Layout<'a>,
}

impl Weights<'_> {
    fn row(&self, n: usize) -> &[u8] {
        &self.bytes[n * self.layout.k..(n + 1) * self.layout.k]
    }

    fn row_path(&self, x: &[f32], rows: usize, bias: Option<&[f32]>, out: &mut [f32], threads: usize) {
        let out_features = out.len() / rows.max(1);
        let stride = x.len() / rows.max(1);
        let dst = openmp::SharedMut(out.as_mut_ptr());
        openmp::parallel(threads, |thread, team| {
            for n in openmp::share(out_features, thread, team) {
                let dots = self.row_dots(n, x, stride, rows);
                for (r, dot) in dots.iter().enumerate().take(rows) {
                    // SAFETY: each thread writes only its own weight rows' columns of `out`,
                    // which holds `rows * out_features` elements and outlives `parallel`.
                    unsafe { *dst.get().add(r * out_features + n) = dot + bias.map_or(0.0, |b| b[n]) };
                }
            }
        });
    }

    /// Weight row `n` dotted with the first `rows` (1 or 2) rows of `x`.
    fn row_dots(&self, n: usize, x: &[f32], stride: usize, rows: usize) -> [f32; ROW_PATH_MAX_ROWS] {
        let scales = self.layout.row_scales(n);
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2, FMA and F16C; `x` holds `rows` rows of `stride >= k`.
            return unsafe {
                match rows {
                    1 => {
                        let [d] = avx2::row_dot::<1>(self.row(n), x, stride, scales, self.layout.group);
                        [d, 0.0]
                    }
                    _ => avx2::row_dot::<2>(self.row(n), x, stride, scales, self.layout.group),
                }
            };
        }
        let row = self.row(n);
        std::array::from_fn(|r| {
            let xs = &x[(r * stride).min(x.len())..];
            let dot = |k: usize| e4m3_to_f32(row[k]) * scales[k / self.layout.group] * xs[k];
            if r < rows {
                (0..self.layout.k).map(dot).sum()
            } else {
                0.0
            }
        })
    }
}

impl Tiles for Weights<'_> {
    fn decode(&self, rows: Range<usize>, k0: usize, len: usize, dst: &mut [f32]) {
        let k = self.layout.k;
        for (n, out) in rows.zip(dst.chunks_exact_mut(len)) {
            let scales = self.layout.row_scales(n);
            let end = (k0 + len).min(k);
            let mut done = k0;
            #[cfg(target_arch = "x86_64")]
            if avx2::available() && end > k0 {
                // SAFETY: the CPU has AVX2, FMA and F16C; columns `k0..end` are in the row.
                done = unsafe { avx2::decode(self.row(n), k0..end, scales, self.layout.group, out) };
            }
            let row = self.row(n);
            for c in done..end {
                out[c - k0] = e4m3_to_f32(row[c]) * scales[c / self.layout.group];
            }
            out[end.max(k0) - k0..].fill(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_near, linear, values};

    #[test]
    fn decodes_every_byte_as_the_format_defines() {
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0xfe), -448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        for b in 0..=255u8 {
            let v = e4m3_to_f32(b);
            if !v.is_nan() {
                assert_eq!(round_to_e4m3(v), v, "{b:#x} is its own rounding");
            }
        }
        assert_eq!(round_to_e4m3(1000.0), 448.0);
        assert_eq!(round_to_e4m3(-1.0625), -1.0, "a tie goes to the even mantissa");
        assert_eq!(round_to_e4m3(1.1875), 1.25);
    }

    /// An `[n, k]` weight of every finite byte in turn, and its f32 value under `scale`.
    fn weight(n: usize, k: usize, scale: Fp8Scale<'_>) -> (Vec<u8>, Vec<f32>) {
        let bytes: Vec<u8> = (0..n * k)
            .map(|i| ((i * 37 + 11) % 256) as u8)
            .map(|b| if b & 0x7f == 0x7f { 0 } else { b })
            .collect();
        let layout = Layout::new(scale, Fp8Shape { rows: 1, out_features: n, in_features: k }).unwrap();
        let dense = (0..n * k)
            .map(|i| e4m3_to_f32(bytes[i]) * layout.row_scales(i / k)[(i % k) / layout.group])
            .collect();
        (bytes, dense)
    }

    #[test]
    fn weight_only_matches_the_dequantized_product() {
        for (rows, n, k) in [(1, 19, 64usize), (2, 33, 100), (3, 17, 256), (9, 40, 48)] {
            let (channel, blocks) = (values(n, 4), values(n.div_ceil(16) * k.div_ceil(16), 5));
            for scale in [
                Fp8Scale::Tensor(0.5),
                Fp8Scale::Channel(&channel),
                Fp8Scale::Block { scales: &blocks, bo: 16, bi: 16 },
            ] {
                let (bytes, dense) = weight(n, k, scale);
                let (x, b) = (values(rows * k, 6), values(n, 7));
                let mut out = vec![f32::NAN; rows * n];
                let shape = Fp8Shape { rows, out_features: n, in_features: k };
                let w = Fp8Weight { bytes: &bytes, scale };
                fp8_linear(&x, w, Some(&b), Fp8Input::None, &mut out, shape, 2).unwrap();
                let want = linear(&x, &dense, Some(&b), rows, n, k);
                let norm = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let scaled = |v: &[f32]| v.iter().map(|e| e / norm).collect::<Vec<_>>();
                assert_near(&scaled(&out), &scaled(&want), &format!("{shape:?} {scale:?}"));
            }
        }
    }

    #[test]
    fn refuses_group_input_without_blocks_and_odd_blocks() {
        let shape = Fp8Shape { rows: 1, out_features: 1, in_features: 32 };
        let mut out = [0.0];
        let tensor = Fp8Weight { bytes: &[0; 32], scale: Fp8Scale::Tensor(1.0) };
        let err = fp8_linear(&[0.0; 32], tensor, None, Fp8Input::Group, &mut out, shape, 1).unwrap_err();
        assert!(err.to_string().contains("(\"group\" needs block_size). Given: \"group\""), "{err}");
        let block =
            Fp8Weight { bytes: &[0; 32], scale: Fp8Scale::Block { scales: &[1.0; 4], bo: 1, bi: 10 } };
        let err = fp8_linear(&[0.0; 32], block, None, Fp8Input::None, &mut out, shape, 1).unwrap_err();
        assert!(err.to_string().contains("Given: (1, 10)"), "{err}");
    }
}
