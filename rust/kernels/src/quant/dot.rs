//! One GGUF weight row dotted with `M` quantized activation rows, in integers.
//!
//! Each weight format is a marker type ([`Q4_0`] ... [`Q6K`]); [`rows_dot`] picks, once per
//! call, the compiled product for a format, a tile height `M` and the best instruction set the
//! CPU has ([`Isa`]). Every product computes, per 32-element sub-block `j` of the row and each
//! activation row `r` (see [`super::subblocks`] for the shared form and [`super::act`] for `x`):
//!
//! `d_x[r][j] · Σ_half scale_half · Σ_i q_i · xq_i  +  min_j · d_x[r][j] · Σ_i xq_i`
//!
//! so a weight block is unpacked once and met by `M` activation blocks (the tile), and each
//! weight byte is read once per tile. Integer sums are exact; the float work is one convert and
//! multiply-add per 32 elements and activation row.
//!
//! - portable: the unpacked form, scalar, for CPUs without AVX2 (and the tests' second opinion);
//! - `x86`: AVX2 (`vpmaddubsw` + `vpmaddwd`), or `vpdpbusd` from AVX-VNNI or AVX512-VNNI (on
//!   256-bit vectors, whose 32 bytes are one sub-block), blocks unpacked in registers. The
//!   K-quants' activations share one scale per super-block, so there the sub-blocks' integer
//!   scales apply in integers and the float work is per 256 elements (`x86::kquants`).

#[cfg(target_arch = "x86_64")]
mod x86;

use super::act::{Row, BLOCK};
use super::subblocks::{self, Unpacked};
use super::GgmlType;

/// A compiled product: `weight_row` (whole blocks) against `M` rows whose activation blocks
/// cover it.
///
/// # Safety
/// Each of the rows must hold `weight_row.len() / block_bytes * block_len / 32` activation
/// blocks, and the CPU must have the instructions of the [`Isa`] it was picked for.
pub(crate) type RowsDot<const M: usize> = unsafe fn(&[u8], &[Row<'_>; M]) -> [f32; M];

/// The instruction sets the products are compiled for, slowest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    /// Scalar Rust.
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX2 with AVX-VNNI's `vpdpbusd` (Alder Lake, Zen 5 and later).
    AvxVnni,
    /// AVX2 with AVX512-VNNI's `vpdpbusd` on 256-bit vectors (Cascade Lake, Zen 4 and later).
    Avx512Vnni,
}

impl Isa {
    /// The best set this CPU has.
    pub fn detect() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            use std::sync::OnceLock;
            static ISA: OnceLock<Isa> = OnceLock::new();
            *ISA.get_or_init(|| Isa::available().iter().copied().max().unwrap_or(Isa::Portable))
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::Portable
    }

    /// Every set this CPU can run, worst first. Looked up once: every product checks its set
    /// against this, and building the list each time was a heap allocation per product.
    pub fn available() -> &'static [Isa] {
        static SETS: std::sync::OnceLock<Vec<Isa>> = std::sync::OnceLock::new();
        SETS.get_or_init(|| {
            let mut sets = vec![Isa::Portable];
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has_avx2_fma() && is_x86_feature_detected!("f16c") {
                sets.push(Isa::Avx2);
                if is_x86_feature_detected!("avxvnni") {
                    sets.push(Isa::AvxVnni);
                }
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                {
                    sets.push(Isa::Avx512Vnni);
                }
            }
            sets
        })
    }
}

/// The product for `ggml_type` with tile height `M` on `isa` (which the caller checked this CPU
/// has); `None` for the float types, which have no integer form.
pub(crate) fn rows_dot<const M: usize>(ggml_type: GgmlType, isa: Isa) -> Option<RowsDot<M>> {
    macro_rules! pick {
        ($format:ty) => {
            match isa {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::avx2::<$format, M> as RowsDot<M>,
                #[cfg(target_arch = "x86_64")]
                Isa::AvxVnni => x86::avx_vnni::<$format, M>,
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => x86::avx512_vnni::<$format, M>,
                _ => portable::<$format, M>,
            }
        };
    }
    Some(match ggml_type {
        GgmlType::Q4_0 => pick!(Q4_0),
        GgmlType::Q4_1 => pick!(Q4_1),
        GgmlType::Q5_0 => pick!(Q5_0),
        GgmlType::Q5_1 => pick!(Q5_1),
        GgmlType::Q8_0 => pick!(Q8_0),
        GgmlType::Q4K => pick!(Q4K),
        GgmlType::Q5K => pick!(Q5K),
        GgmlType::Q6K => pick!(Q6K),
        GgmlType::F16 | GgmlType::Bf16 => return None,
    })
}

/// A block format as the portable product sees it.
pub(crate) trait Format {
    /// Bytes of one block.
    const BYTES: usize;
    /// 32-element sub-blocks in one block.
    const SUBS: usize;
    /// Adds block `block`'s products with the rows' sub-blocks from `first` on to `acc`.
    fn add_block<const M: usize>(block: &[u8], xs: &[Row<'_>; M], first: usize, acc: &mut [f32; M]);
}

macro_rules! format {
    ($name:ident, $bytes:literal, $subs:literal, $unpack:path) => {
        #[allow(non_camel_case_types)]
        pub(crate) struct $name;
        impl Format for $name {
            const BYTES: usize = $bytes;
            const SUBS: usize = $subs;
            #[inline(always)]
            fn add_block<const M: usize>(block: &[u8], xs: &[Row<'_>; M], first: usize, acc: &mut [f32; M]) {
                let block: &[u8; $bytes] = block.try_into().expect("whole blocks");
                add_unpacked(&$unpack(block), xs, first, acc);
            }
        }
    };
}
format!(Q4_0, 18, 1, subblocks::q4_0);
format!(Q4_1, 20, 1, subblocks::q4_1);
format!(Q5_0, 22, 1, subblocks::q5_0);
format!(Q5_1, 24, 1, subblocks::q5_1);
format!(Q8_0, 34, 1, subblocks::q8_0);
format!(Q4K, 144, 8, subblocks::q4_k);
format!(Q5K, 176, 8, subblocks::q5_k);
format!(Q6K, 210, 8, subblocks::q6_k);

/// The portable product (safe; an `unsafe fn` pointer only to share [`RowsDot`]'s type).
fn portable<F: Format, const M: usize>(row: &[u8], xs: &[Row<'_>; M]) -> [f32; M] {
    let mut acc = [0.0; M];
    for (b, block) in row.chunks_exact(F::BYTES).enumerate() {
        F::add_block(block, xs, b * F::SUBS, &mut acc);
    }
    acc
}

#[inline(always)]
fn add_unpacked<const S: usize, const M: usize>(
    u: &Unpacked<S>,
    xs: &[Row<'_>; M],
    first: usize,
    acc: &mut [f32; M],
) {
    for j in 0..S {
        let s = first + j;
        for (acc, x) in acc.iter_mut().zip(xs) {
            let xq = &x.q[s * BLOCK..][..BLOCK];
            let half = |h: usize| -> i32 {
                let range = 16 * h..16 * (h + 1);
                u.q[j][range.clone()].iter().zip(&xq[range]).map(|(&w, &x)| i32::from(w) * i32::from(x)).sum()
            };
            let scaled = u.scale[j][0] * half(0) as f32 + u.scale[j][1] * half(1) as f32;
            *acc += x.d[s] * scaled + u.min[j] * x.sum[s];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::act::QuantizedRows;
    use crate::quant::subblocks::tests::random_blocks;
    use crate::quant::{dequantize, GgmlType};
    use crate::test_support::values;

    const TYPES: [GgmlType; 8] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// `x · w` in f64 for each of `rows` rows, and the bound activation quantization keeps the
    /// integer product within (see `act`): `Σ_g max_g|x| / 254 · Σ_{i in g} |w_i|` over groups
    /// of `group`, plus 1e-5 of `Σ|x||w|` for the f32 accumulation.
    fn reference(x: &[f32], w: &[f32], rows: usize, group: usize) -> Vec<(f64, f64)> {
        let k = w.len();
        (0..rows)
            .map(|r| {
                let x = &x[r * k..(r + 1) * k];
                let dot = x.iter().zip(w).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                let mut bound = 0.0;
                for (xb, wb) in x.chunks(group).zip(w.chunks(group)) {
                    let amax = xb.iter().fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
                    let l1: f64 = wb.iter().map(|v| f64::from(v.abs())).sum();
                    let abs: f64 = xb.iter().zip(wb).map(|(a, b)| f64::from((a * b).abs())).sum();
                    bound += amax / 254.0 * l1 * (1.0 + 1e-5) + 1e-5 * abs;
                }
                (dot, bound)
            })
            .collect()
    }

    fn check_product<const M: usize>(t: GgmlType, isa: Isa, blocks: usize, seed: u32) {
        let row = random_blocks(t, blocks, seed);
        let k = blocks * t.block_len();
        let mut w = vec![0.0f32; k];
        dequantize(t, &row, &mut w, 1).unwrap();
        let x: Vec<f32> =
            values(M * k, seed).iter().enumerate().map(|(i, v)| v * (1 + i % 5) as f32).collect();
        let q = QuantizedRows::new(&x, k, t.block_len());
        let rows: [Row<'_>; M] = std::array::from_fn(|r| q.row(r));
        let dot = rows_dot::<M>(t, isa).unwrap();
        // SAFETY: the rows cover the weight row; `isa` is one this CPU has.
        let got = unsafe { dot(&row, &rows) };
        for (r, (want, bound)) in reference(&x, &w, M, t.block_len()).into_iter().enumerate() {
            let err = (f64::from(got[r]) - want).abs();
            assert!(err <= bound, "{t:?} {isa:?} M={M} row {r}: {} vs {want} (bound {bound})", got[r]);
        }
    }

    #[test]
    fn every_format_on_every_isa_stays_within_the_quantization_bound() {
        for &isa in Isa::available() {
            for t in TYPES {
                let blocks = if t.block_len() == BLOCK { 28 } else { 4 };
                check_product::<1>(t, isa, blocks, 1);
                check_product::<2>(t, isa, blocks, 2);
                check_product::<3>(t, isa, blocks, 3);
                check_product::<4>(t, isa, blocks, 4);
            }
        }
    }

    #[test]
    fn vector_products_agree_with_the_portable_one() {
        let isas = Isa::available();
        for t in TYPES {
            let row = random_blocks(t, 3, 9);
            let k = 3 * t.block_len();
            let x = values(2 * k, 9);
            let q = QuantizedRows::new(&x, k, t.block_len());
            let rows = [q.row(0), q.row(1)];
            // SAFETY: as above.
            let want = unsafe { rows_dot::<2>(t, Isa::Portable).unwrap()(&row, &rows) };
            for &isa in isas {
                let got = unsafe { rows_dot::<2>(t, isa).unwrap()(&row, &rows) };
                for (g, w) in got.iter().zip(&want) {
                    assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{t:?} {isa:?}: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn float_types_have_no_integer_product() {
        assert!(rows_dot::<1>(GgmlType::F16, Isa::Portable).is_none());
        assert!(rows_dot::<1>(GgmlType::Bf16, Isa::detect()).is_none());
    }
}
