//! `out = x · weightᵀ + bias` for a few rows of `x`: the decode step's linear layers.
//!
//! Each weight row is read once, from start to end, and dotted with every row of `x`; threads
//! take contiguous ranges of weight rows. One straight stream per thread is what the memory
//! system serves fastest: on the development machine, interleaving four weight rows per pass (to
//! share loads of `x`) streamed at 16 GB/s where one row at a time reaches 23 GB/s per thread.

use crate::element::Element;
use crate::error::check_len;
use crate::simd::SimdElement;
use crate::{openmp, simd, KernelError};

/// Most rows of `x` per call. Measured on a decode step's weights (fp32, 2 threads): one row
/// streams at 29 GB/s against oneDNN's 22, two at 25 against 20; at three and four rows oneDNN's
/// blocked GEMM is as fast or faster (16-20 GB/s here).
pub const MAX_ROWS: usize = 2;

/// `x` is `[rows, in_features]`, `weight` is `[out_features, in_features]`, `out` is
/// `[rows, out_features]`, all row-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvShape {
    pub rows: usize,
    pub out_features: usize,
    pub in_features: usize,
}

/// `out[r, n] = Σ_k x[r, k] · weight[n, k] + bias[n]`, in f32 and rounded once to `T`, split over
/// up to `threads` threads of the OpenMP team (see [`openmp`]).
pub fn gemv<T: SimdElement>(
    x: &[T],
    weight: &[T],
    bias: Option<&[T]>,
    out: &mut [T],
    shape: GemvShape,
    threads: usize,
) -> Result<(), KernelError> {
    let GemvShape { rows, out_features, in_features } = shape;
    if !(1..=MAX_ROWS).contains(&rows) {
        return Err(KernelError::Value {
            name: "rows",
            limit: format!("between 1 and {MAX_ROWS}"),
            value: rows as i64,
        });
    }
    check_len("x", x.len(), rows * in_features)?;
    check_len("weight", weight.len(), out_features * in_features)?;
    check_len("out", out.len(), rows * out_features)?;
    if let Some(bias) = bias {
        check_len("bias", bias.len(), out_features)?;
    }
    let x: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    let out = openmp::SharedMut(out.as_mut_ptr());
    openmp::parallel(threads, |thread, team| {
        let span = openmp::share(out_features, thread, team);
        let job = Job { x: &x, weight, bias, shape };
        // SAFETY: every thread writes only its own weight rows' columns of `out`, whose length
        // was checked above, and `out` outlives `parallel`.
        unsafe { job.run(span, &out) };
    });
    Ok(())
}

struct Job<'a, T> {
    x: &'a [f32],
    weight: &'a [T],
    bias: Option<&'a [T]>,
    shape: GemvShape,
}

impl<T: SimdElement> Job<'_, T> {
    /// # Safety
    /// `out` must address `rows * out_features` elements, of which no other thread writes the
    /// columns in `span`.
    unsafe fn run(&self, span: std::ops::Range<usize>, out: &openmp::SharedMut<T>) {
        match self.shape.rows {
            1 => self.run_rows::<1>(span, out),
            _ => self.run_rows::<2>(span, out),
        }
    }

    unsafe fn run_rows<const M: usize>(&self, span: std::ops::Range<usize>, out: &openmp::SharedMut<T>) {
        let GemvShape { out_features, in_features: k, .. } = self.shape;
        for n in span {
            let row = &self.weight[n * k..(n + 1) * k];
            let dots = dot_rows::<T, M>(row, self.x);
            let bias = self.bias.map_or(0.0, |b| b[n].to_f32());
            for (r, dot) in dots.into_iter().enumerate() {
                *out.get().add(r * out_features + n) = T::from_f32(dot + bias);
            }
        }
    }
}

/// `[row · x[0], …, row · x[M-1]]`, `x` holding `M` rows as long as `row`.
#[inline]
fn dot_rows<T: SimdElement, const M: usize>(row: &[T], x: &[f32]) -> [f32; M] {
    #[cfg(target_arch = "x86_64")]
    if simd::has_avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA; `x` holds `M` rows of `row.len()`.
        return unsafe { dot_rows_avx2::<T, M>(row, x) };
    }
    dot_rows_plain::<T, M>(row, x)
}

fn dot_rows_plain<T: Element, const M: usize>(row: &[T], x: &[f32]) -> [f32; M] {
    let k = row.len();
    std::array::from_fn(|r| row.iter().zip(&x[r * k..(r + 1) * k]).map(|(w, v)| w.to_f32() * v).sum())
}

/// Two accumulators per row of `x` over 16-element steps, so consecutive FMAs don't wait on each
/// other; the tail of `k` past a multiple of 16 goes element by element.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_rows_avx2<T: SimdElement, const M: usize>(row: &[T], x: &[f32]) -> [f32; M] {
    use std::arch::x86_64::*;
    let k = row.len();
    let (w, xs) = (row.as_ptr(), x.as_ptr());
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    let mut j = 0;
    while j + 16 <= k {
        let (w0, w1) = (T::load8(w.add(j)), T::load8(w.add(j + 8)));
        for (r, pair) in acc.iter_mut().enumerate() {
            let xr = xs.add(r * k + j);
            pair[0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), pair[0]);
            pair[1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr.add(8)), pair[1]);
        }
        j += 16;
    }
    std::array::from_fn(|r| {
        let tail: f32 = (j..k).map(|i| row[i].to_f32() * x[r * k + i]).sum();
        simd::sum8(_mm256_add_ps(acc[r][0], acc[r][1])) + tail
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{linear, values};
    use crate::Bf16;

    fn reference(x: &[f32], w: &[f32], bias: Option<&[f32]>, shape: GemvShape) -> Vec<f32> {
        linear(x, w, bias, shape.rows, shape.out_features, shape.in_features)
    }

    #[test]
    fn matches_the_reference_in_f32() {
        // k = 37 leaves a tail after two 16-wide steps; 896 is Qwen2-0.5B's hidden size.
        for (rows, n, k) in [(1, 7, 37), (2, 5, 896), (2, 33, 16), (1, 9, 100), (1, 1, 1)] {
            let shape = GemvShape { rows, out_features: n, in_features: k };
            let (x, w, b) = (values(rows * k, 1), values(n * k, 2), values(n, 3));
            for bias in [None, Some(b.as_slice())] {
                let mut out = vec![0.0f32; rows * n];
                gemv(&x, &w, bias, &mut out, shape, 2).unwrap();
                let want = reference(&x, &w, bias, shape);
                for (got, want) in out.iter().zip(&want) {
                    assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{shape:?}: {got} vs {want}");
                }
            }
        }
    }

    #[test]
    fn bf16_rounds_the_f32_result_once() {
        let shape = GemvShape { rows: 2, out_features: 11, in_features: 70 };
        let to_bf16 = |v: Vec<f32>| v.into_iter().map(Bf16::from_f32).collect::<Vec<_>>();
        let (x, w, b) = (to_bf16(values(140, 4)), to_bf16(values(770, 5)), to_bf16(values(11, 6)));
        let mut out = vec![Bf16::default(); 22];
        gemv(&x, &w, Some(&b), &mut out, shape, 1).unwrap();
        let widen = |v: &[Bf16]| v.iter().map(|e| e.to_f32()).collect::<Vec<_>>();
        let want = reference(&widen(&x), &widen(&w), Some(&widen(&b)), shape);
        for (got, want) in out.iter().zip(&want) {
            let ulp = want.abs() / 128.0;
            assert!((got.to_f32() - want).abs() <= ulp.max(1e-3), "{} vs {want}", got.to_f32());
        }
    }

    #[test]
    fn the_plain_loop_agrees_with_the_vector_one() {
        let (x, w) = (values(2 * 45, 7), values(45, 8));
        let plain = dot_rows_plain::<f32, 2>(&w, &x);
        let fast = dot_rows::<f32, 2>(&w, &x);
        for (a, b) in plain.iter().zip(&fast) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn refuses_shapes_that_do_not_fit() {
        let shape = GemvShape { rows: 1, out_features: 2, in_features: 3 };
        let mut out = vec![0.0f32; 2];
        let err = gemv(&[0.0; 2], &[0.0; 6], None, &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "x", expected: 3, actual: 2 });
        let err = gemv(&[0.0; 3], &[0.0; 6], Some(&[0.0; 3]), &mut out, shape, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "bias", expected: 2, actual: 3 });
        let three = GemvShape { rows: 3, ..shape };
        let err = gemv(&[0.0; 9], &[0.0; 6], None, &mut [0.0; 6], three, 1).unwrap_err();
        assert!(err.to_string().contains("`rows` must be between 1 and 2. Given: 3"), "{err}");
    }
}
