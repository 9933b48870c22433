use super::act::{max_abs, quantize_row, quantize_row_u8};
use super::*;
use crate::test_support::{assert_near, values};

/// The kernels this CPU runs.
fn kernels() -> Vec<Kernel> {
    let all = [Kernel::Avx512Vnni, Kernel::AvxVnni, Kernel::Avx2, Kernel::Portable];
    all.into_iter().filter(|k| *k == Kernel::Portable || kernel_runs(*k)).collect()
}

fn kernel_runs(kernel: Kernel) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        match kernel {
            Kernel::Avx512Vnni => x86::has_avx512_vnni(),
            Kernel::AvxVnni => x86::has_avx_vnni(),
            Kernel::Avx2 => crate::simd::has_avx2_fma(),
            Kernel::Portable => true,
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        kernel == Kernel::Portable
    }
}

/// The definition, element by element: quantize each row, integer dot products, scale.
fn reference(x: &[f32], qw: &[i8], ws: &[f32], bias: &[f32], act: ActQuant, shape: W8a8Shape) -> Vec<f32> {
    let W8a8Shape { rows, out_features: n, in_features: k } = shape;
    let mut out = vec![0.0; rows * n];
    for r in 0..rows {
        let row = &x[r * k..(r + 1) * k];
        let (scale, zp) = match act {
            ActQuant::Dynamic => (row.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0, 0),
            ActQuant::Static { scale, zero_point } => (scale, zero_point),
        };
        let q: Vec<i64> = row
            .iter()
            .map(|v| {
                if scale > 0.0 {
                    ((v / scale).round_ties_even() as i64 + i64::from(zp)).clamp(-128, 127)
                } else {
                    0
                }
            })
            .collect();
        for j in 0..n {
            let dot: i64 = (0..k).map(|i| (q[i] - i64::from(zp)) * i64::from(qw[j * k + i])).sum();
            out[r * n + j] = scale * ws[j] * dot as f32 + bias[j];
        }
    }
    out
}

#[test]
fn every_kernel_matches_the_definition() {
    let shapes = [(1, 37, 64), (2, 16, 5), (3, 33, 100), (7, 17, 256), (33, 40, 31), (13, 64, 96)];
    let acts = [
        ActQuant::Dynamic,
        ActQuant::Static { scale: 0.004, zero_point: 3 },
        ActQuant::Static { scale: 0.01, zero_point: -128 },
    ];
    for (rows, n, k) in shapes {
        let shape = W8a8Shape { rows, out_features: n, in_features: k };
        let mut x = values(rows * k, 1);
        x[..k].fill(0.0); // a row of zeros: scale 0 under dynamic quantization
        let qw: Vec<i8> =
            (0..n * k).map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(9) as i8).collect();
        let (ws, bias) = (values(n, 2), values(n, 3));
        let mut packed = vec![0u8; w8a8_packed_len(n, k)];
        w8a8_pack(&qw, &mut packed, n, k, 2).unwrap();
        let weight = W8a8Weight { packed: &packed, weight_scale: &ws };
        for act in acts {
            let want = reference(&x, &qw, &ws, &bias, act, shape);
            for kernel in kernels() {
                let mut out = vec![f32::NAN; rows * n];
                run(&x, weight, Some(&bias), act, &mut out, shape, 2, kernel);
                assert_near(&out, &want, &format!("{kernel:?} {act:?} {shape:?}"));
            }
        }
    }
}

#[test]
fn the_vector_quantization_matches_the_scalar_one() {
    // Values on and between rounding ties (k + 0.5 steps of the scale), past the clamps, a
    // NaN, and rows whose length leaves a tail after the 16-lane loop.
    let scale = 0.25;
    let mut row: Vec<f32> = (0..70).map(|i| (i as f32 - 35.0) * 0.125).collect();
    row.extend([40.0, -40.0, 1e6, -1e6, f32::NAN, 0.0, -0.0]);
    row[3] = f32::NAN; // in the vector loops' part too
    for len in [5, 16, 33, row.len()] {
        let row = &row[..len];
        let plain = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        assert_eq!(max_abs(row).to_bits(), plain.to_bits(), "max_abs of {len}");
        for zp in [0, 3, -128, 127] {
            let mut q = vec![0i32; len];
            quantize_row(row, scale, zp, &mut q);
            let want: Vec<u8> = q.iter().map(|v| (v + 128) as u8).collect();
            let mut got = vec![0u8; len];
            quantize_row_u8(row, scale, zp, &mut vec![0i32; len], &mut got);
            assert_eq!(got, want, "{len} values, zero point {zp}");
        }
    }
}

#[test]
fn packs_quads_of_sixteen_features_then_their_sums() {
    let (n, k) = (17, 6);
    let qw: Vec<i8> = (0..n * k).map(|i| (i % 200) as i8).collect();
    let mut packed = vec![0u8; w8a8_packed_len(n, k)];
    w8a8_pack(&qw, &mut packed, n, k, 1).unwrap();
    assert_eq!(packed.len(), 32 * 8 + 32 * 4);
    assert_eq!(packed[4 * 3 + 1] as i8, qw[3 * k + 1]); // quad 0, feature 3, k 1
    assert_eq!(packed[64 + 4 * 2 + 1] as i8, qw[2 * k + 5]); // quad 1, feature 2, k 5
    assert_eq!(packed[64 + 4 * 2 + 2], 0); // k 6: padding
    let sums = &packed[32 * 8..];
    let sum = |i: usize| i32::from_le_bytes(sums[4 * i..4 * i + 4].try_into().unwrap());
    assert_eq!(sum(16), qw[16 * k..17 * k].iter().map(|&v| i32::from(v)).sum::<i32>());
    assert_eq!(sum(17), 0);
}

#[test]
fn refuses_static_settings_out_of_range() {
    let shape = W8a8Shape { rows: 1, out_features: 1, in_features: 4 };
    let packed = vec![0u8; w8a8_packed_len(1, 4)];
    let weight = W8a8Weight { packed: &packed, weight_scale: &[1.0] };
    let call = |act| w8a8_linear(&[0.0; 4], weight, None, act, &mut [0.0], shape, 1).unwrap_err().to_string();
    let err = call(ActQuant::Static { scale: 0.0, zero_point: 0 });
    assert!(err.contains("`input_scale` must be finite and > 0. Given: 0"), "{err}");
    let err = call(ActQuant::Static { scale: 1.0, zero_point: 200 });
    assert!(err.contains("`input_zero_point` must be between -128 and 127. Given: 200"), "{err}");
}
