use super::*;
use crate::test_support::{assert_near, linear, values};

/// Random stored values of `bits` for an `[n, k]` weight, their scales and mins.
struct Case {
    q: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

fn case(bits: u32, n: usize, k: usize, group: usize, seed: u32) -> Case {
    let levels = 1u32 << bits;
    let q = (0..n * k).map(|i| ((i as u32).wrapping_mul(2_654_435_761).rotate_right(7) + seed) % levels);
    let q = q.map(|v| if bits == 8 { (v as i32 - 128) as i8 as u8 } else { v as u8 }).collect();
    let groups = n * k / group;
    let scales = values(groups, seed + 1).iter().map(|s| 0.01 + s.abs() * 0.1).collect();
    Case { q, scales, mins: values(groups, seed + 2) }
}

/// The dequantized weight, in f32 as the format defines it.
fn dense(c: &Case, bits: u32, n: usize, k: usize, group: usize, mins: bool) -> Vec<f32> {
    (0..n * k)
        .map(|i| {
            let q = if bits == 8 { f32::from(c.q[i] as i8) } else { f32::from(c.q[i]) };
            let g = (i / k) * (k / group) + (i % k) / group;
            q * c.scales[g] + if mins { c.mins[g] } else { 0.0 }
        })
        .collect()
}

fn run(c: &Case, bits: u32, shape: WqShape, x: &[f32], mins: bool, bias: Option<&[f32]>) -> Vec<f32> {
    let WqShape { rows, out_features: n, in_features: k, .. } = shape;
    let mut packed = vec![0u8; int4_packed_len(n, k)];
    let weight = if bits == 4 {
        pack_int4(&c.q, &mut packed, n, k, 2).unwrap();
        QWeight::Int4(&packed)
    } else {
        // SAFETY: `u8` and `i8` have the same size and alignment.
        QWeight::Int8(unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) })
    };
    let mut out = vec![f32::NAN; rows * n];
    let mins = mins.then_some(c.mins.as_slice());
    let weight = WqWeight { q: weight, scales: &c.scales, mins };
    wq_linear(x, weight, bias, &mut out, shape, 2).unwrap();
    out
}

#[test]
fn matches_dequantize_then_matmul_for_every_layout() {
    // Per group sizes 16 (odd and even counts of groups), 32 to 256, and per channel with
    // in_features not a multiple of 32 (int8 rows then end in a tail).
    let layouts = [(64, 16), (48, 16), (96, 32), (128, 64), (384, 128), (512, 256), (37, 37), (160, 160)];
    for bits in [4, 8] {
        for (k, group) in layouts {
            for (rows, n) in [(1, 13), (2, 37), (3, 5), (7, 12), (33, 25)] {
                let shape = WqShape { rows, out_features: n, in_features: k, group_size: group };
                let c = case(bits, n, k, group, (k + rows) as u32);
                let (x, b) = (values(rows * k, 9), values(n, 10));
                for (mins, bias) in [(false, None), (true, Some(b.as_slice()))] {
                    let want = linear(&x, &dense(&c, bits, n, k, group, mins), bias, rows, n, k);
                    let got = run(&c, bits, shape, &x, mins, bias);
                    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                    let what = format!("bits {bits} {shape:?} mins {mins}");
                    let (got, want): (Vec<_>, Vec<_>) =
                        got.iter().zip(&want).map(|(g, w)| (g / scale, w / scale)).unzip();
                    assert_near(&got, &want, &what);
                }
            }
        }
    }
}

#[test]
fn the_scalar_formula_agrees_with_the_vector_loops() {
    let (n, k, group) = (5, 96, 32);
    for bits in [4, 8] {
        let c = case(bits, n, k, group, 3);
        let mut packed = vec![0u8; int4_packed_len(n, k)];
        pack_int4(&c.q.iter().map(|v| v & 15).collect::<Vec<_>>(), &mut packed, n, k, 1).unwrap();
        // SAFETY: as in `run`.
        let q8 = unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) };
        let q = if bits == 4 { QWeight::Int4(&packed) } else { QWeight::Int8(q8) };
        let shape = WqShape { rows: 1, out_features: n, in_features: k, group_size: group };
        let layout = Layout::new(shape, q).unwrap();
        let w = Weights { q, scales: &c.scales, mins: Some(&c.mins), layout };
        let mut row = vec![0.0; k];
        w.decode_row(2, 0, &mut row);
        let scalar: Vec<f32> = (0..k).map(|i| w.value(2, i)).collect();
        assert_near(&row, &scalar, "decoded row");
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn each_vector_path_here_agrees_with_the_scalar_formula() {
    // Group 16 (its own loop), per group, per channel with an int8 tail; one and two rows.
    for (k, group) in [(80, 16), (48, 16), (96, 32), (256, 128), (20, 20), (37, 37), (160, 160)] {
        for bits in [4, 8] {
            let n = 3;
            let c = case(bits, n, k, group, k as u32);
            let mut packed = vec![0u8; int4_packed_len(n, k)];
            if bits == 4 {
                pack_int4(&c.q, &mut packed, n, k, 1).unwrap();
            }
            // SAFETY: as in `run`.
            let q8 = unsafe { std::slice::from_raw_parts(c.q.as_ptr().cast(), c.q.len()) };
            let q = if bits == 4 { QWeight::Int4(&packed) } else { QWeight::Int8(q8) };
            let shape = WqShape { rows: 2, out_features: n, in_features: k, group_size: group };
            let layout = Layout::new(shape, q).unwrap();
            let w = Weights { q, scales: &c.scales, mins: None, layout };
            let mut x = values(2 * layout.k_padded, 4);
            for r in 0..2 {
                x[r * layout.k_padded + k..(r + 1) * layout.k_padded].fill(0.0);
            }
            let scalar = |r: usize| (0..k).map(|i| w.value(1, i) * x[r * layout.k_padded + i]).sum::<f32>();
            let want = [scalar(0), scalar(1)];
            let mut paths = Vec::new();
            if simd::has_avx2_fma() {
                paths.push(("avx2", w.row_dot_avx2::<2>(1, &x, layout.k_padded)));
            }
            if simd::has_avx512f() && w.takes_avx512() {
                // SAFETY: the CPU has AVX-512F; `takes_avx512` holds.
                paths.push(("avx512", unsafe { w.row_dot_avx512::<2>(1, &x, layout.k_padded) }));
                let [one] = unsafe { w.row_dot_avx512::<1>(1, &x, layout.k_padded) };
                paths.push(("avx512 one row", [one, want[1]]));
            }
            for (path, got) in paths {
                let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
                let norm = |v: [f32; 2]| v.map(|e| e / scale);
                assert_near(&norm(got), &norm(want), &format!("{path} bits {bits} k {k} group {group}"));
            }
        }
    }
}

#[test]
fn refuses_layouts_and_values_it_cannot_take() {
    let shape = WqShape { rows: 1, out_features: 2, in_features: 96, group_size: 48 };
    let (x, s, q) = (vec![0.0; 96], vec![0.0; 4], vec![0i8; 192]);
    let w = WqWeight { q: QWeight::Int8(&q), scales: &s, mins: None };
    let mut out = vec![0.0; 2];
    let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
    assert!(
        err.to_string().contains("`group_size` must be 16, a multiple of 32, or in_features (96). Given: 48"),
        "{err}"
    );
    let shape = WqShape { group_size: 40, ..shape };
    let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
    assert!(err.to_string().contains("a divisor of in_features (96). Given: 40"), "{err}");
    let shape = WqShape { group_size: 32, ..shape };
    let err = wq_linear(&x, w, None, &mut out, shape, 1).unwrap_err();
    assert_eq!(err, KernelError::Size { name: "scales", expected: 6, actual: 4 });
    let err = pack_int4(&[1, 16, 3], &mut [0u8; 16], 1, 3, 1).unwrap_err();
    assert!(err.to_string().contains("`q` must be between 0 and 15. Given: 16"), "{err}");
}

#[test]
fn int4_rows_pack_into_padded_blocks() {
    let q: Vec<u8> = (0..40).map(|i| (i % 16) as u8).collect();
    let mut packed = vec![0xffu8; int4_packed_len(1, 40)];
    pack_int4(&q, &mut packed, 1, 40, 1).unwrap();
    assert_eq!(packed.len(), 32);
    assert_eq!(packed[0], q[0] | (q[16] << 4));
    assert_eq!(packed[16 + 7], q[39]);
    assert_eq!(packed[16 + 8..], [0; 8]);
}
