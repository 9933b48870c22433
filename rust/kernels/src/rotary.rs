//! Rotary position embedding, GPT-NeoX style (the two halves of each head's rotary part rotate
//! against each other), of the query or key heads of a projection's output.
//!
//! The input is a strided view: the fused qkv projection puts a token's query heads, key heads
//! and value heads side by side in one row, so each call reads `heads` heads at the start of
//! every `row_stride`-long row and writes them, rotated, to a contiguous output. Arithmetic is
//! f32, rounded once per element.

use crate::element::Element;
use crate::error::{check_len, KernelError};
use crate::openmp;

/// Where the heads are and what rotates.
#[derive(Clone, Copy, Debug)]
pub struct RotaryShape {
    /// Tokens.
    pub rows: usize,
    /// Elements from one token's first head to the next token's.
    pub row_stride: usize,
    /// Heads rotated per token, contiguous from the row's start.
    pub heads: usize,
    pub head_size: usize,
    /// Leading elements of each head that rotate (even, at most `head_size`).
    pub rotary_dim: usize,
}

/// Rows per thread, at least: decode steps' few rows are not worth waking the team for.
const MIN_ROWS_PER_THREAD: usize = 16;

/// Writes `out` (`[rows, heads * head_size]`): the heads of `x` (`rows` rows of `row_stride`
/// elements, the last one may stop after its heads) rotated by `cos_sin[positions[row]]`, a
/// `[max_position, rotary_dim]` table of cosines then sines; elements past `rotary_dim` are copied.
pub fn rotate_neox<T: Element>(
    x: &[T],
    positions: &[i64],
    cos_sin: &[T],
    out: &mut [T],
    shape: RotaryShape,
    threads: usize,
) -> Result<(), KernelError> {
    validate(x.len(), positions, cos_sin.len(), &shape)?;
    let RotaryShape { rows, row_stride, heads, head_size, rotary_dim } = shape;
    let width = heads * head_size;
    check_len("out", out.len(), rows * width)?;
    openmp::for_each_share(out, width, MIN_ROWS_PER_THREAD, threads, |rows, out| {
        for (row, out) in rows.zip(out.chunks_exact_mut(width)) {
            let table = &cos_sin[positions[row] as usize * rotary_dim..][..rotary_dim];
            let (cos, sin) = table.split_at(rotary_dim / 2);
            let x = &x[row * row_stride..][..width];
            for (x, out) in x.chunks_exact(head_size).zip(out.chunks_exact_mut(head_size)) {
                rotate_head(&x[..rotary_dim], cos, sin, &mut out[..rotary_dim]);
                out[rotary_dim..].copy_from_slice(&x[rotary_dim..]);
            }
        }
    });
    Ok(())
}

#[inline]
fn rotate_head<T: Element>(x: &[T], cos: &[T], sin: &[T], out: &mut [T]) {
    let (x1, x2) = x.split_at(cos.len());
    let (o1, o2) = out.split_at_mut(cos.len());
    for ((((a, b), c), s), (oa, ob)) in x1.iter().zip(x2).zip(cos).zip(sin).zip(o1.iter_mut().zip(o2)) {
        let (a, b, c, s) = (a.to_f32(), b.to_f32(), c.to_f32(), s.to_f32());
        *oa = T::from_f32(a * c - b * s);
        *ob = T::from_f32(b * c + a * s);
    }
}

fn validate(len: usize, positions: &[i64], table_len: usize, s: &RotaryShape) -> Result<(), KernelError> {
    if s.rotary_dim == 0 || !s.rotary_dim.is_multiple_of(2) || s.rotary_dim > s.head_size {
        let limit = format!("even, in 2..={}", s.head_size);
        return Err(KernelError::Value { name: "rotary_dim", limit, value: s.rotary_dim as i64 });
    }
    if s.heads * s.head_size > s.row_stride {
        let limit = format!("at most row_stride / head_size ({})", s.row_stride / s.head_size.max(1));
        return Err(KernelError::Value { name: "heads", limit, value: s.heads as i64 });
    }
    check_len("positions", positions.len(), s.rows)?;
    let needed = if s.rows == 0 { 0 } else { (s.rows - 1) * s.row_stride + s.heads * s.head_size };
    check_len("x", len, needed)?;
    check_len("cos_sin", table_len, table_len / s.rotary_dim * s.rotary_dim)?;
    let max_position = table_len / s.rotary_dim;
    if let Some(&bad) = positions.iter().find(|&&p| p < 0 || p as usize >= max_position) {
        return Err(KernelError::Value {
            name: "positions",
            limit: format!("in 0..{max_position}"),
            value: bad,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_each_head_by_its_rows_angle() {
        // One token at position 1 with two heads of 4 (rotary 2), in a row of 10 (the rest is v).
        let shape = RotaryShape { rows: 1, row_stride: 10, heads: 2, head_size: 4, rotary_dim: 2 };
        let angle = 0.5f32;
        let table = [1.0, 0.0, angle.cos(), angle.sin()];
        let x = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let mut out = [0.0f32; 8];
        rotate_neox(&x, &[1], &table, &mut out, shape, 1).unwrap();
        let (c, s) = (angle.cos(), angle.sin());
        let want = [c - 2.0 * s, 2.0 * c + s, 3.0, 4.0, 5.0 * c - 6.0 * s, 6.0 * c + 5.0 * s, 7.0, 8.0];
        for (g, w) in out.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{out:?}");
        }
    }

    #[test]
    fn refuses_positions_past_the_table_and_short_buffers() {
        let shape = RotaryShape { rows: 2, row_stride: 8, heads: 1, head_size: 4, rotary_dim: 4 };
        let table = vec![0.0f32; 3 * 4];
        let mut out = [0.0f32; 8];
        let err = rotate_neox(&[0.0f32; 12], &[0, 3], &table, &mut out, shape, 1).unwrap_err();
        assert!(err.to_string().contains("`positions` must be in 0..3. Given: 3"), "{err}");
        let err = rotate_neox(&[0.0f32; 11], &[0, 1], &table, &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "x", expected: 12, actual: 11 });
        let err = rotate_neox(&[0.0f32; 12], &[0, 1], &table, &mut out[..7], shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "out", expected: 8, actual: 7 });
        let odd = RotaryShape { rotary_dim: 3, ..shape };
        assert!(rotate_neox(&[0.0f32; 12], &[0, 1], &table, &mut out, odd, 1).is_err());
    }
}
