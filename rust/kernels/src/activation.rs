//! Gated activations of a fused `[gate, up]` projection.

use crate::element::{round, Element};
use crate::error::{check_len, KernelError};
use crate::openmp::for_each_share;
use crate::simd::{exp, multiversion};

/// Below this much output per thread, waking the team costs more than the work.
const MIN_ELEMS_PER_THREAD: usize = 16 * 1024;

/// `out[r] = silu(x[r, :width]) * x[r, width:]` for `x`: `[rows, 2 * width]` and `out`:
/// `[rows, width]`. As in torch, `silu` is rounded to the element type before the multiply.
pub fn silu_and_mul<T: Element>(
    x: &[T],
    width: usize,
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    if width == 0 {
        return Err(KernelError::Value { name: "width", limit: "> 0".into(), value: 0 });
    }
    let rows = x.len() / (2 * width);
    check_len("x", x.len(), rows * 2 * width)?;
    check_len("out", out.len(), rows * width)?;
    for_each_share(out, width, MIN_ELEMS_PER_THREAD.div_ceil(width), threads, |rows, out| {
        let x = &x[rows.start * 2 * width..rows.end * 2 * width];
        for (out, x) in out.chunks_exact_mut(width).zip(x.chunks_exact(2 * width)) {
            silu_mul_row::<T>(x, out);
        }
    });
    Ok(())
}

multiversion!(fn silu_mul_row<T>(x: &[T], out: &mut [T]) => silu_mul_row_body);

#[inline(always)]
fn silu_mul_row_body<T: Element>(x: &[T], out: &mut [T]) {
    let (gate, up) = x.split_at(out.len());
    silu_mul(gate, up, out);
}

/// `out = silu(gate) * up`, element by element; inlined into vectorized callers (the GEMM's
/// gated epilogue too), so the loop vectorizes with their target features.
#[inline(always)]
pub(crate) fn silu_mul<T: Element>(gate: &[T], up: &[T], out: &mut [T]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        let g = g.to_f32();
        *o = T::from_f32(round::<T>(g / (1.0 + exp(-g))) * u.to_f32());
    }
}
