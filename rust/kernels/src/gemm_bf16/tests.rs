use super::*;
use crate::test_support::{linear, values};

fn bf16s(len: usize, seed: u32) -> Vec<Bf16> {
    values(len, seed).into_iter().map(Bf16::from_f32).collect()
}

fn widen(v: &[Bf16]) -> Vec<f32> {
    v.iter().map(|e| e.to_f32()).collect()
}

fn packed(w: &[Bf16], n: usize, k: usize) -> Vec<Bf16> {
    let mut p = vec![Bf16(0xffff); packed_len_bf16(n, k)];
    pack_weight_bf16(w, &mut p, n, k, 2).unwrap();
    p
}

/// The kernels this CPU runs; the others are covered where the CPU has them.
fn kernels_here() -> Vec<Bf16Kernel> {
    Bf16Kernel::ALL.into_iter().filter(|k| k.runs_here()).collect()
}

/// The f64 product: every kernel multiplies `x` as given (f32 `x` is never rounded to bf16).
fn reference(x: &[f32], w: &[Bf16], bias: Option<&[f32]>, shape: GemmShape) -> Vec<f32> {
    linear(x, &widen(w), bias, shape.rows, shape.out_features, shape.in_features)
}

fn assert_close(got: &[f32], want: &[f32], k: usize, slack: f32, what: &str) {
    // f32 sums of k products in [-1, 1]: the rounding error grows with k.
    let tol = 1e-6 * (k as f32 + 1.0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol + slack * w.abs(), "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn every_kernel_here_matches_the_f64_reference() {
    // Rows 1 to 9 around the AVX2 (6) and AVX-512 (8) blocks, 300 across a slab; columns not a
    // multiple of 8, 16 or the 48-wide panel; odd and even k.
    let mut cases: Vec<(usize, usize, usize)> =
        (1..=9).map(|rows| (rows, 37 + 11 * rows, 2 * rows + 3)).collect();
    cases.extend([(2, 100, 129), (3, 1153, 64), (1, 17, 896), (300, 40, 33), (7, 48, 1)]);
    for kernel in kernels_here() {
        for &(rows, n, k) in &cases {
            let shape = GemmShape { rows, out_features: n, in_features: k };
            let (x, w, b) = (values(rows * k, 2), bf16s(n * k, 3), values(n, 4));
            let p = packed(&w, n, k);
            for bias in [None, Some(b.as_slice())] {
                for threads in [1, 2] {
                    let mut out = vec![f32::NAN; rows * n];
                    gemm_bf16(&x, &p, bias, &mut out, shape, kernel, threads).unwrap();
                    let want = reference(&x, &w, bias, shape);
                    assert_close(&out, &want, k, 0.0, &format!("{kernel:?} {shape:?} threads {threads}"));
                }
            }
        }
    }
}

#[test]
fn bf16_activations_in_and_out_round_the_f32_sum_once() {
    for kernel in kernels_here() {
        for (rows, n, k) in [(1, 70, 45), (2, 33, 16), (5, 130, 77)] {
            let shape = GemmShape { rows, out_features: n, in_features: k };
            let (x, w, b) = (bf16s(rows * k, 5), bf16s(n * k, 6), bf16s(n, 7));
            let mut out = vec![Bf16(0xffff); rows * n];
            gemm_bf16(&x, &packed(&w, n, k), Some(&b), &mut out, shape, kernel, 2).unwrap();
            let want = reference(&widen(&x), &w, Some(&widen(&b)), shape);
            assert_close(&widen(&out), &want, k, 1.0 / 256.0, &format!("{kernel:?} {shape:?}"));
        }
    }
}

#[test]
fn bf16_activations_through_whole_tiles_and_what_they_leave_over() {
    // Rows around the AMX path's 16-row tiles and 32-row blocks; k around its steps of 32 (pairs
    // of 16) with and without a remainder; columns across the 48-wide panels, partial vectors.
    let cases = [
        (16, 48, 32),
        (17, 47, 33),
        (31, 100, 64),
        (32, 16, 95),
        (33, 130, 896),
        (48, 1153, 64),
        (70, 96, 2),
    ];
    for kernel in kernels_here() {
        for (rows, n, k) in cases {
            let shape = GemmShape { rows, out_features: n, in_features: k };
            // `x` read in place (an even k, 4-byte aligned) and copied (one element along).
            let held = bf16s(rows * k + 1, 10);
            let (w, b) = (bf16s(n * k, 11), bf16s(n, 12));
            for (x, threads) in [(&held[..rows * k], 1), (&held[1..], 2)] {
                let want = reference(&widen(x), &w, Some(&widen(&b)), shape);
                let mut out = vec![Bf16(0xffff); rows * n];
                gemm_bf16(x, &packed(&w, n, k), Some(&b), &mut out, shape, kernel, threads).unwrap();
                let what = format!("{kernel:?} {shape:?} threads {threads}");
                assert_close(&widen(&out), &want, k, 1.0 / 256.0, &what);
            }
        }
    }
}

#[test]
fn the_kernels_agree_with_the_portable_loop_on_a_qwen2_shape() {
    let shape = GemmShape { rows: 13, out_features: 1152, in_features: 896 };
    let (x, w) = (values(13 * 896, 8), bf16s(1152 * 896, 9));
    let p = packed(&w, 1152, 896);
    let mut want = vec![0.0f32; 13 * 1152];
    gemm_bf16(&x, &p, None, &mut want, shape, Bf16Kernel::Portable, 2).unwrap();
    for kernel in kernels_here() {
        let mut got = vec![f32::NAN; 13 * 1152];
        gemm_bf16(&x, &p, None, &mut got, shape, kernel, 2).unwrap();
        assert_close(&got, &want, 896, 0.0, &format!("{kernel:?}"));
    }
}

#[test]
fn no_input_features_leaves_the_bias() {
    for kernel in kernels_here() {
        let shape = GemmShape { rows: 4, out_features: 20, in_features: 0 };
        let b = values(20, 8);
        let mut out = vec![f32::NAN; 80];
        gemm_bf16(&[], &[], Some(&b), &mut out, shape, kernel, 2).unwrap();
        assert_eq!(out, b.repeat(4), "{kernel:?}");
    }
}

#[test]
fn refuses_buffers_that_do_not_fit_and_kernels_the_cpu_lacks() {
    let shape = GemmShape { rows: 3, out_features: 20, in_features: 4 };
    let mut out = vec![0.0f32; 60];
    let portable = Bf16Kernel::Portable;
    let err = gemm_bf16(&[0.0; 12], &[Bf16(0); 80], None, &mut out, shape, portable, 1).unwrap_err();
    assert_eq!(err, KernelError::Size { name: "packed", expected: 128, actual: 80 });
    let err = gemm_bf16(&[0.0; 11], &[Bf16(0); 128], None, &mut out, shape, portable, 1).unwrap_err();
    assert_eq!(err, KernelError::Size { name: "x", expected: 12, actual: 11 });
    if let Some(missing) = Bf16Kernel::ALL.into_iter().find(|k| !k.runs_here()) {
        let err = gemm_bf16(&[0.0; 12], &[Bf16(0); 128], None, &mut out, shape, missing, 1).unwrap_err();
        assert!(err.to_string().contains("`kernel` must be one this CPU runs"), "{err}");
    }
}

#[test]
fn the_tiles_run_where_the_cpu_reports_amx() {
    // Linux lists `amx_bf16` among the CPU's flags only where the kernel enabled it, so there the
    // tile state must have been granted and the AMX loop must be the widest.
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    if flags.split_whitespace().any(|f| f == "amx_bf16")
        && flags.split_whitespace().any(|f| f == "avx512_bf16")
    {
        assert_eq!(Bf16Kernel::best(), Bf16Kernel::Amx);
    }
}

#[test]
fn kernel_names_round_trip() {
    for kernel in Bf16Kernel::ALL {
        assert_eq!(Bf16Kernel::from_name(kernel.name()), Some(kernel));
    }
    assert!(Bf16Kernel::best().runs_here());
}
