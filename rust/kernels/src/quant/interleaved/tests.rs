use super::*;
use crate::quant::act::QuantizedRows;
use crate::quant::matmul::{matmul_stacked_on, Activations, QuantWeight};
use crate::quant::subblocks::tests::random_blocks;
use crate::test_support::values;

const FORMATS: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

/// `out` rows of random `t` blocks, `pad` bytes apart (a strided view), and their row stride.
fn rows(t: GgmlType, out: usize, in_features: usize, pad: usize) -> (Vec<u8>, usize) {
    let row_bytes = in_features / BLOCK * t.block_bytes();
    let blocks = random_blocks(t, out * in_features / BLOCK, 11);
    let stride = row_bytes + pad;
    let mut data = vec![0xa5u8; out * stride];
    for (dst, src) in data.chunks_exact_mut(stride).zip(blocks.chunks_exact(row_bytes)) {
        dst[..row_bytes].copy_from_slice(src);
    }
    (data, stride)
}

fn interleaved(t: GgmlType, data: &[u8], stride: usize, out: usize, in_features: usize) -> Vec<u8> {
    let mut dst = vec![0xffu8; interleaved_len(t, out, in_features)];
    interleave(t, data, stride, out, in_features, &mut dst).unwrap();
    dst
}

#[test]
fn interleaving_keeps_every_byte_and_deinterleaving_gives_the_rows_back() {
    for t in FORMATS {
        for (out, in_features) in [(16, 32), (13, 64), (35, 96)] {
            let (data, stride) = rows(t, out, in_features, 3);
            let packed = interleaved(t, &data, stride, out, in_features);
            // The file's bytes for the rows, padded to whole groups.
            assert_eq!(packed.len(), out.div_ceil(GROUP) * GROUP * in_features / BLOCK * t.block_bytes());
            let row_bytes = in_features / BLOCK * t.block_bytes();
            let mut back = vec![0u8; out * row_bytes];
            deinterleave(t, &packed, out, in_features, &mut back).unwrap();
            for (n, row) in back.chunks_exact(row_bytes).enumerate() {
                assert_eq!(row, &data[n * stride..][..row_bytes], "{t:?} {out}x{in_features} row {n}");
            }
        }
    }
}

/// Every tile height through `matmul`, interleaved against the file's layout on the same ISA.
fn matmul_both(isa: Isa, t: GgmlType, out: usize, in_features: usize, rows_x: usize) -> (Vec<f32>, Vec<f32>) {
    let (data, stride) = rows(t, out, in_features, 5);
    let packed = interleaved(t, &data, stride, out, in_features);
    let plain = QuantWeight {
        ggml_type: t,
        data: &data,
        row_stride: stride,
        out_features: out,
        in_features,
        interleaved: false,
    };
    let groups = QuantWeight { data: &packed, interleaved: true, ..plain };
    let (x, bias) = (values(rows_x * in_features, 9), values(out, 4));
    let mut want = vec![0.0f32; rows_x * out];
    let mut got = vec![0.0f32; rows_x * out];
    matmul_stacked_on(isa, Activations::Int8, &[plain], &x, rows_x, Some(&bias), &mut want, 2).unwrap();
    matmul_stacked_on(isa, Activations::Int8, &[groups], &x, rows_x, Some(&bias), &mut got, 2).unwrap();
    (got, want)
}

#[test]
fn groups_give_the_row_products_up_to_float_order() {
    // The integer sums are the same; only the order of the f32 additions differs.
    for t in FORMATS {
        for rows_x in [1, 2, 3, 4, 7] {
            let (got, want) = matmul_both(Isa::Portable, t, 37, 96, rows_x);
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{t:?} rows={rows_x}: {g} vs {w}");
            }
        }
    }
}

#[test]
fn the_vector_group_product_is_the_portable_one_bit_for_bit() {
    if !Isa::available().contains(&Isa::Avx512Vnni) {
        eprintln!("skipped: this CPU has no AVX512-VNNI");
        return;
    }
    for t in FORMATS {
        let format = Format::of(t).unwrap();
        let (out, in_features) = (GROUP, 128);
        let (data, stride) = rows(t, out, in_features, 0);
        let packed = interleaved(t, &data, stride, out, in_features);
        let x = values(3 * in_features, 2);
        let q = QuantizedRows::new(&x, in_features, BLOCK);
        let xs = [q.row(0), q.row(1), q.row(2)];
        let blocks = in_features / BLOCK;
        // SAFETY: one whole group of `blocks` blocks; the CPU has AVX512-VNNI (checked above).
        let (vector, scalar) = unsafe {
            (
                group_dot::<3>(format, Isa::Avx512Vnni)(packed.as_ptr(), blocks, &xs),
                group_dot::<3>(format, Isa::Portable)(packed.as_ptr(), blocks, &xs),
            )
        };
        assert_eq!(vector, scalar, "{t:?}");
        let (got, want) = matmul_both(Isa::Avx512Vnni, t, 50, 64, 5);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{t:?}: {g} vs {w}");
        }
    }
}

#[test]
fn refuses_other_formats_and_short_buffers() {
    let mut dst = vec![0u8; 1024];
    let err = interleave(GgmlType::Q4K, &[0; 144], 144, 1, 256, &mut dst).unwrap_err().to_string();
    assert!(err.contains("Q4_0, Q4_1 or Q8_0"), "{err}");
    let err = interleave(GgmlType::Q4_0, &[0; 18], 18, 1, 48, &mut dst).unwrap_err().to_string();
    assert!(err.contains("`in_features` must be a multiple of 32. Given: 48"), "{err}");
    let err = interleave(GgmlType::Q4_0, &[0; 18], 18, 2, 32, &mut dst).unwrap_err().to_string();
    assert!(err.contains("`rows` must be at least 36 bytes"), "{err}");
    let err = interleave(GgmlType::Q4_0, &[0; 36], 18, 2, 32, &mut dst[..100]).unwrap_err().to_string();
    assert!(err.contains("`dst` must be at least 288 bytes"), "{err}");
    let data = [0u8; 100];
    let w = QuantWeight {
        ggml_type: GgmlType::Q4_0,
        data: &data,
        row_stride: 0,
        out_features: 2,
        in_features: 32,
        interleaved: true,
    };
    let err =
        matmul_stacked_on(Isa::Portable, Activations::Int8, &[w], &[0.0; 32], 1, None, &mut [0.0; 2], 1)
            .unwrap_err()
            .to_string();
    assert!(err.contains("`data` must be at least 288 bytes (2 interleaved rows)"), "{err}");
}
