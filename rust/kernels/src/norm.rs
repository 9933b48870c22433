//! RMSNorm over the last dimension, with the residual add fused in.
//!
//! Rounding follows the torch modules (`ferrollm.model_executor.layers.norm`): the sum
//! `x + residual` is rounded to the element type (it is the residual stream), normalised in f32,
//! and then either rounded before the weight multiplies (Llama) or multiplied by `1 + weight` in
//! f32 and rounded once (Gemma).

use crate::element::{round, Element};
use crate::error::{check_len, KernelError};
use crate::openmp::{for_each_share, for_each_share_pair};
use crate::simd::{multiversion, sum_squares};

/// The norm's parameters.
#[derive(Clone, Copy)]
pub struct RmsNormWeight<'a, T> {
    /// `[hidden]`.
    pub weight: &'a [T],
    pub eps: f32,
    /// Gemma's flavour: scale by `1 + weight`, rounding once at the end.
    pub gemma: bool,
}

/// Below this many elements per thread, waking the team costs more than the work.
const MIN_ELEMS_PER_THREAD: usize = 16 * 1024;

/// `out = norm(x)`; `x` and `out` are `[rows, hidden]`, split by rows over up to `threads`.
pub fn rms_norm<T: Element>(
    x: &[T],
    norm: RmsNormWeight<'_, T>,
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    let hidden = check_shapes(x.len(), &norm, out.len())?;
    for_each_share(out, hidden, MIN_ELEMS_PER_THREAD.div_ceil(hidden), threads, |rows, out| {
        let x = &x[rows.start * hidden..rows.end * hidden];
        for (out, x) in out.chunks_exact_mut(hidden).zip(x.chunks_exact(hidden)) {
            normalize_row::<T>(x, &norm, out);
        }
    });
    Ok(())
}

/// `residual_out = x + residual; out = norm(residual_out)`, all `[rows, hidden]`.
pub fn fused_add_rms_norm<T: Element>(
    x: &[T],
    residual: &[T],
    norm: RmsNormWeight<'_, T>,
    out: &mut [T],
    residual_out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    let hidden = check_shapes(x.len(), &norm, out.len())?;
    check_len("residual", residual.len(), x.len())?;
    check_len("residual_out", residual_out.len(), x.len())?;
    let min_rows = MIN_ELEMS_PER_THREAD.div_ceil(hidden);
    for_each_share_pair(out, residual_out, hidden, hidden, min_rows, threads, |rows, out, sum| {
        let span = rows.start * hidden..rows.end * hidden;
        let (x, residual) = (&x[span.clone()], &residual[span]);
        add_rows::<T>(x, residual, sum);
        for (out, sum) in out.chunks_exact_mut(hidden).zip(sum.chunks_exact(hidden)) {
            normalize_row::<T>(sum, &norm, out);
        }
    });
    Ok(())
}

multiversion!(fn add_rows<T>(x: &[T], residual: &[T], sum: &mut [T]) => add_rows_body);

#[inline(always)]
fn add_rows_body<T: Element>(x: &[T], residual: &[T], sum: &mut [T]) {
    for (s, (a, b)) in sum.iter_mut().zip(x.iter().zip(residual)) {
        *s = T::from_f32(a.to_f32() + b.to_f32());
    }
}

fn check_shapes<T>(len: usize, norm: &RmsNormWeight<'_, T>, out_len: usize) -> Result<usize, KernelError> {
    let hidden = norm.weight.len();
    if hidden == 0 {
        return Err(KernelError::Value { name: "weight", limit: "non-empty".into(), value: 0 });
    }
    check_len("x", len, len / hidden * hidden)?;
    check_len("out", out_len, len)?;
    Ok(hidden)
}

multiversion!(fn normalize_row<T>(x: &[T], norm: &RmsNormWeight<'_, T>, out: &mut [T]) => normalize_row_body);

#[inline(always)]
fn normalize_row_body<T: Element>(x: &[T], norm: &RmsNormWeight<'_, T>, out: &mut [T]) {
    let inv = 1.0 / (sum_squares(x) / x.len() as f32 + norm.eps).sqrt();
    if norm.gemma {
        for ((o, x), w) in out.iter_mut().zip(x).zip(norm.weight) {
            *o = T::from_f32(x.to_f32() * inv * (1.0 + w.to_f32()));
        }
    } else {
        for ((o, x), w) in out.iter_mut().zip(x).zip(norm.weight) {
            *o = T::from_f32(w.to_f32() * round::<T>(x.to_f32() * inv));
        }
    }
}
