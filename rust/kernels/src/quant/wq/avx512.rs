//! The weight-only dot products on AVX-512F: [`super::avx2`]'s loops on 16 lanes.
//!
//! For groups of 16 or 32 elements only. A 32-element block is two vectors (elements 0-15 and
//! 16-31), scaled by their group's scale as they are loaded and multiplied into the running sums:
//! no per-group accumulators to clear, add up and scale, which is what bounds AVX2's loop at such
//! groups. An int8 LM head of 49152 × 576 in groups of 32 (a Q8_0 table, as SmolLM2 ties it)
//! took 2.7-3.4 ms here against AVX2's 3.5-6.5 (2 threads, Xeon with AVX-512, a noisy VM,
//! interleaved runs). With wider groups AVX2's group sums were as fast or faster (64: 3.2
//! against 3.6-4.4 ms; per channel 2.8 against 3.0), so int8 rows in those stay on AVX2.
//!
//! Int4 rows in groups of any multiple of 32 take [`dot_int4_table`]: the sixteen values a nibble
//! can stand for, times the group's scale, sit in one register, and `vpermps` picks each
//! element's value by its nibble (it reads only an index's low four bits), in place of a mask,
//! two conversions and two multiplications per block.

use std::arch::x86_64::*;

use super::avx2::{Int4, Int8};
use super::{Layout, QWeight, Weights, INT4_BLOCK};

/// A stored block of 32 elements as two vectors of f32.
trait Block {
    /// # Safety
    /// `row` addresses a stored row with at least `block + 1` whole blocks; the CPU has AVX-512F.
    unsafe fn load(row: *const u8, block: usize) -> [__m512; 2];
}

impl Block for Int4 {
    /// 16 bytes: the low nibbles of bytes 0-15 are elements 0-15, the high ones 16-31.
    #[inline(always)]
    unsafe fn load(row: *const u8, block: usize) -> [__m512; 2] {
        let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(block * INT4_BLOCK / 2).cast()));
        let low = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0f));
        [_mm512_cvtepi32_ps(low), _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(bytes))]
    }
}

impl Block for Int8 {
    #[inline(always)]
    unsafe fn load(row: *const u8, block: usize) -> [__m512; 2] {
        let p = row.add(block * INT4_BLOCK);
        [widen_i8(p), widen_i8(p.add(16))]
    }
}

/// Sixteen signed bytes at `p` as f32 lanes. (A function, not a closure: a closure would not
/// inherit its caller's target features, and each intrinsic in it would become a call.)
#[inline(always)]
unsafe fn widen_i8(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
}

/// Elements `16 half .. 16 half + 16` of block `b` of row `m` of `x` (rows `stride` apart).
#[inline(always)]
unsafe fn xv(x: *const f32, stride: usize, m: usize, b: usize, half: usize) -> __m512 {
    _mm512_loadu_ps(x.add(m * stride + b * INT4_BLOCK + 16 * half))
}

impl Weights<'_> {
    /// [`Weights::row_dot_avx2`] on AVX-512F where [`Weights::takes_avx512`]: weight row `n`
    /// dotted with `M` rows of `x` (`stride` apart, each zero-padded to `k_padded`), scales
    /// applied, mins not.
    ///
    /// # Safety
    /// The CPU has AVX-512F; `self.takes_avx512()`.
    pub(super) unsafe fn row_dot_avx512<const M: usize>(
        &self,
        n: usize,
        x: &[f32],
        stride: usize,
    ) -> [f32; M] {
        let layout = self.layout;
        let scales = &self.scales[n * layout.groups..(n + 1) * layout.groups];
        // SAFETY: the row holds `blocks` whole blocks, `x` holds `M` rows of `k_padded >= 32 *
        // blocks` and `scales` the row's groups.
        let dots = match self.q {
            QWeight::Int4(q) if layout.group.is_multiple_of(INT4_BLOCK) => {
                dot_int4_table::<M>(q.as_ptr().add(n * layout.row_bytes), x, stride, scales, layout)
            }
            QWeight::Int4(q) => {
                dot::<Int4, M>(q.as_ptr().add(n * layout.row_bytes), x, stride, scales, layout)
            }
            QWeight::Int8(q) => {
                dot::<Int8, M>(q.as_ptr().add(n * layout.row_bytes).cast(), x, stride, scales, layout)
            }
        };
        std::array::from_fn(|m| dots[m] + self.tail_dot(n, &x[m * stride..]))
    }
}

/// Σ over the row's whole blocks of `q · x · scale`, for `M` rows of `x`.
#[target_feature(enable = "avx512f")]
unsafe fn dot<B: Block, const M: usize>(
    row: *const u8,
    x: &[f32],
    stride: usize,
    scales: &[f32],
    layout: Layout,
) -> [f32; M] {
    let x = x.as_ptr();
    // Two accumulators per row, one per half of a block.
    let mut total = [[_mm512_setzero_ps(); 2]; M];
    for b in 0..layout.blocks {
        // A block is group b (groups of 32), or groups 2b and 2b + 1 (groups of 16; past the
        // last group only in an int4 row's padding, where x is zero).
        let (low, high) = if layout.group == INT4_BLOCK {
            (scales[b], scales[b])
        } else {
            (scales[2 * b], scales.get(2 * b + 1).copied().unwrap_or(0.0))
        };
        let v = B::load(row, b);
        let w = [_mm512_mul_ps(v[0], _mm512_set1_ps(low)), _mm512_mul_ps(v[1], _mm512_set1_ps(high))];
        for (m, t) in total.iter_mut().enumerate() {
            t[0] = _mm512_fmadd_ps(w[0], xv(x, stride, m, b, 0), t[0]);
            t[1] = _mm512_fmadd_ps(w[1], xv(x, stride, m, b, 1), t[1]);
        }
    }
    // Loops, not `map`: closures do not inherit the target features (see `widen_i8`).
    let mut dots = [0.0; M];
    for (dot, [a, b]) in dots.iter_mut().zip(total) {
        *dot = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
    dots
}

/// Block `b` of an int4 row as two vectors of `level · scale`, picked from `levels` (0-15).
/// (A function, not a closure: see `widen_i8`.)
#[inline(always)]
unsafe fn int4_values(row: *const u8, b: usize, scale: f32, levels: __m512) -> [__m512; 2] {
    let table = _mm512_mul_ps(levels, _mm512_set1_ps(scale));
    // 16 bytes: the low nibbles of bytes 0-15 are elements 0-15, the high ones 16-31.
    let bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(b * INT4_BLOCK / 2).cast()));
    [_mm512_permutexvar_ps(bytes, table), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(bytes), table)]
}

/// [`dot`] for int4 rows whose groups are a multiple of 32 elements (whole blocks): each block's
/// values picked from its group's table of `level · scale`. Two sets of accumulators, for even
/// and odd blocks, so that no sum waits on the previous block's.
#[target_feature(enable = "avx512f")]
unsafe fn dot_int4_table<const M: usize>(
    row: *const u8,
    x: &[f32],
    stride: usize,
    scales: &[f32],
    layout: Layout,
) -> [f32; M] {
    let x = x.as_ptr();
    let levels = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
    let mut group_scales = BlockScales { scales, per_group: layout.group / INT4_BLOCK, group: 0, done: 0 };
    let mut even = [[_mm512_setzero_ps(); 2]; M];
    let mut odd = [[_mm512_setzero_ps(); 2]; M];
    let pairs = layout.blocks / 2;
    for p in 0..pairs {
        let b = 2 * p;
        let v = int4_values(row, b, group_scales.next(), levels);
        let w = int4_values(row, b + 1, group_scales.next(), levels);
        for (m, (e, o)) in even.iter_mut().zip(odd.iter_mut()).enumerate() {
            add_block(e, v, x, stride, m, b);
            add_block(o, w, x, stride, m, b + 1);
        }
    }
    if layout.blocks % 2 == 1 {
        let b = layout.blocks - 1;
        let v = int4_values(row, b, group_scales.next(), levels);
        for (m, e) in even.iter_mut().enumerate() {
            add_block(e, v, x, stride, m, b);
        }
    }
    let mut dots = [0.0; M];
    for (dot, ([a, b], [c, d])) in dots.iter_mut().zip(even.into_iter().zip(odd)) {
        *dot = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a, b), _mm512_add_ps(c, d)));
    }
    dots
}

/// Each block's group scale in turn, counted rather than divided out (a division per block cost
/// more than the block's products).
struct BlockScales<'a> {
    scales: &'a [f32],
    per_group: usize,
    group: usize,
    /// Blocks of `group` handed out.
    done: usize,
}

impl BlockScales<'_> {
    #[inline(always)]
    fn next(&mut self) -> f32 {
        let scale = self.scales[self.group];
        self.done += 1;
        if self.done == self.per_group {
            (self.group, self.done) = (self.group + 1, 0);
        }
        scale
    }
}

/// `t += values · x`: block `b` of row `m` of `x`, one accumulator per half.
#[inline(always)]
unsafe fn add_block(
    t: &mut [__m512; 2],
    values: [__m512; 2],
    x: *const f32,
    stride: usize,
    m: usize,
    b: usize,
) {
    t[0] = _mm512_fmadd_ps(values[0], xv(x, stride, m, b, 0), t[0]);
    t[1] = _mm512_fmadd_ps(values[1], xv(x, stride, m, b, 1), t[1]);
}
