use super::*;
use crate::quant::dequantize;
use crate::quant::subblocks::tests::random_blocks;
use crate::test_support::{linear, values};

/// A weight in the file's layout: `out_features` rows of `t` blocks, `stride` bytes apart.
fn plain(
    t: GgmlType,
    data: &[u8],
    stride: usize,
    out_features: usize,
    in_features: usize,
) -> QuantWeight<'_> {
    QuantWeight { ggml_type: t, data, row_stride: stride, out_features, in_features, interleaved: false }
}

/// A weight of `out` rows of `t` blocks, each row padded by `pad` bytes (a strided view).
fn weight(t: GgmlType, out: usize, in_features: usize, pad: usize) -> (Vec<u8>, Vec<f32>, usize) {
    let row_bytes = in_features / t.block_len() * t.block_bytes();
    let blocks = random_blocks(t, out * in_features / t.block_len(), 7);
    let stride = row_bytes + pad;
    let mut data = vec![0xffu8; out * stride];
    for (dst, src) in data.chunks_exact_mut(stride).zip(blocks.chunks_exact(row_bytes)) {
        dst[..row_bytes].copy_from_slice(src);
    }
    let mut dense = vec![0.0f32; out * in_features];
    dequantize(t, &blocks, &mut dense, 1).unwrap();
    (data, dense, stride)
}

#[test]
fn strided_tiles_with_bias_match_dequantize_then_multiply() {
    for t in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let (out_features, in_features) = (13, 2 * t.block_len().max(64));
        let (data, dense, stride) = weight(t, out_features, in_features, 7);
        let w = plain(t, &data, stride, out_features, in_features);
        for rows in [1, 3, 6] {
            let (x, b) = (values(rows * in_features, 3), values(out_features, 4));
            let mut out = vec![0.0f32; rows * out_features];
            matmul(&w, &x, rows, Some(&b), &mut out, 2).unwrap();
            let want = linear(&x, &dense, Some(&b), rows, out_features, in_features);
            let l1 = dense.chunks(in_features).map(|w| w.iter().map(|v| v.abs()).sum::<f32>());
            let scale = l1.fold(0.0f32, f32::max);
            for (g, e) in out.iter().zip(&want) {
                // |x| <= 1, so each product moves by at most 1/254 of its weight (see `act`).
                assert!((g - e).abs() <= scale / 254.0 + 1e-4, "{t:?} rows={rows}: {g} vs {e}");
            }
        }
    }
}

#[test]
fn residual_activations_bring_the_error_down_by_254() {
    for (t, interleave) in [(GgmlType::Q8_0, false), (GgmlType::Q8_0, true), (GgmlType::Q6K, false)] {
        if interleave && !Isa::available().contains(&Isa::Avx512Vnni) {
            continue;
        }
        let (out_features, in_features) = (37, 2 * t.block_len().max(64));
        let (data, dense, stride) = weight(t, out_features, in_features, 0);
        let mut packed = vec![0u8; interleaved::interleaved_len(t, out_features, in_features)];
        let w = plain(t, &data, stride, out_features, in_features);
        let w = if interleave {
            interleaved::interleave(t, &data, stride, out_features, in_features, &mut packed).unwrap();
            QuantWeight { data: &packed, interleaved: true, ..w }
        } else {
            w
        };
        let l1 = dense.chunks(in_features).map(|w| w.iter().map(|v| v.abs()).sum::<f32>());
        let scale = l1.fold(0.0f32, f32::max);
        // Every tile height: 1, 2 and 3 rows are 2, 4 (one tile) and 6 (4 + 2) quantized rows.
        for rows in [1, 2, 3] {
            let (x, b) = (values(rows * in_features, 8), values(out_features, 2));
            let mut out = vec![0.0f32; rows * out_features];
            let isa = Isa::detect();
            matmul_stacked_on(isa, Activations::Residual, &[w], &x, rows, Some(&b), &mut out, 2).unwrap();
            let want = linear(&x, &dense, Some(&b), rows, out_features, in_features);
            for (g, e) in out.iter().zip(&want) {
                // |x| <= 1: the residual's step is at most 1/127 of the value's.
                let bound = scale / (254.0 * 127.0) + 1e-5 * (1.0 + e.abs());
                assert!((g - e).abs() <= bound, "{t:?} interleaved={interleave} rows={rows}: {g} vs {e}");
            }
        }
    }
}

#[test]
fn stacked_weights_of_mixed_types_match_separate_products() {
    let in_features = 512;
    let parts = [(GgmlType::Q8_0, 21), (GgmlType::Q4K, 5), (GgmlType::Q4_1, 40)];
    let built: Vec<_> = parts.iter().map(|&(t, out)| weight(t, out, in_features, 3)).collect();
    let weights: Vec<_> = parts
        .iter()
        .zip(&built)
        .map(|(&(ggml_type, out_features), (data, _, stride))| QuantWeight {
            ggml_type,
            data,
            row_stride: *stride,
            out_features,
            in_features,
            interleaved: false,
        })
        .collect();
    let total: usize = parts.iter().map(|p| p.1).sum();
    for rows in [1, 2, 5] {
        let (x, b) = (values(rows * in_features, 5), values(total, 6));
        let mut stacked = vec![0.0f32; rows * total];
        matmul_stacked(&weights, &x, rows, Some(&b), &mut stacked, 2).unwrap();
        let mut offset = 0;
        for w in &weights {
            let mut alone = vec![0.0f32; rows * w.out_features];
            let bias = &b[offset..offset + w.out_features];
            matmul(w, &x, rows, Some(bias), &mut alone, 1).unwrap();
            for r in 0..rows {
                let got = &stacked[r * total + offset..][..w.out_features];
                assert_eq!(got, &alone[r * w.out_features..][..w.out_features], "rows={rows}");
            }
            offset += w.out_features;
        }
    }
    let other = QuantWeight { in_features: 256, ..weights[0] };
    let err = matmul_stacked(&[weights[0], other], &values(512, 1), 1, None, &mut [0.0; 42], 1);
    assert!(err.unwrap_err().to_string().contains("the same for every stacked weight (512). Given: 256"));
}

#[test]
fn refuses_what_does_not_fit() {
    let data = vec![0u8; 2 * 18];
    let w = plain(GgmlType::Q4_0, &data, 18, 2, 32);
    let mut out = vec![0.0f32; 2];
    let run = |w: &QuantWeight<'_>, out: &mut [f32]| {
        matmul(w, &[0.0; 32], 1, None, out, 1).unwrap_err().to_string()
    };
    assert!(run(&QuantWeight { ggml_type: GgmlType::F16, ..w }, &mut out)
        .contains("`ggml_type` must be a quantized type"));
    assert!(run(&QuantWeight { in_features: 48, ..w }, &mut out)
        .contains("multiple of Q4_0's block length 32. Given: 48"));
    assert!(run(&QuantWeight { row_stride: 17, ..w }, &mut out)
        .contains("`row_stride` must be at least a row's 18 bytes"));
    assert!(run(&QuantWeight { row_stride: 19, ..w }, &mut out).contains("`data` must be at least 37 bytes"));
    assert!(run(&w, &mut [0.0; 3]).contains("`out` has 3 elements, the shape needs 2"));
}
