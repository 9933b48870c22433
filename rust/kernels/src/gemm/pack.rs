//! Packing a weight into the GEMM's column panels ([`Panels`]): whole, or one block of rows at a
//! time straight from a checkpoint tensor (q, k, v; gate, up; a rank's strided columns), so no
//! merged or contiguous copy is made on the way. Threads take whole panels.

use super::{Panels, PANEL_WIDTH};
use crate::error::{check_len, KernelError};
use crate::openmp;

/// Elements of the packed form of an `[out_features, in_features]` weight.
pub fn packed_len(out_features: usize, in_features: usize) -> usize {
    Panels::new(out_features, in_features).len()
}

/// Packs `weight` (`[out_features, in_features]`, row-major) into `packed`
/// ([`packed_len`] elements) for [`gemm`](super::gemm); padding columns are zero. Threads take whole panels.
pub fn pack_weight(
    weight: &[f32],
    packed: &mut [f32],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    let rows = RowBlock { first: 0, rows: out_features, stride: in_features };
    check_len("weight", weight.len(), out_features * in_features)?;
    pack_weight_rows(weight, rows, packed, out_features, in_features, threads)?;
    let panels = Panels::new(out_features, in_features);
    for col in out_features..panels.padded {
        for k in 0..in_features {
            packed[panels.index(col, k)] = 0.0;
        }
    }
    Ok(())
}

/// Where a block of weight rows sits: rows `first..first + rows` of the whole weight, row `r` of
/// the block starting at element `r * stride` of its buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowBlock {
    pub first: usize,
    pub rows: usize,
    pub stride: usize,
}

impl RowBlock {
    /// Checks that the block's rows fit a weight of `out_features` rows of `in_features` and
    /// that a source of `src_len` elements holds them at its stride.
    pub(crate) fn check(
        self,
        src_len: usize,
        out_features: usize,
        in_features: usize,
    ) -> Result<(), KernelError> {
        let RowBlock { first, rows, stride } = self;
        if first + rows > out_features {
            let limit = format!("<= out_features - rows ({out_features} - {rows})");
            return Err(KernelError::Value { name: "first_row", limit, value: first as i64 });
        }
        if rows > 0 && stride < in_features {
            let limit = format!(">= in_features ({in_features})");
            return Err(KernelError::Value { name: "stride", limit, value: stride as i64 });
        }
        check_len("weight", src_len, if rows == 0 { 0 } else { (rows - 1) * stride + in_features })
    }
}

/// Packs one block of rows of an `[out_features, in_features]` weight into their columns of
/// `packed` (the whole weight's [`packed_len`] elements), leaving every other element as it is.
/// A loader packs each checkpoint tensor (q, k, v; gate, up; a rank's slice) straight from the
/// file this way, with no merged or contiguous copy in between. Threads take whole panels.
pub fn pack_weight_rows(
    src: &[f32],
    block: RowBlock,
    packed: &mut [f32],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    let panels = Panels::new(out_features, in_features);
    check_len("packed", packed.len(), panels.len())?;
    block.check(src.len(), out_features, in_features)?;
    if block.rows == 0 || in_features == 0 {
        return Ok(());
    }
    let first_panel = block.first / PANEL_WIDTH;
    let count = (block.first + block.rows - 1) / PANEL_WIDTH + 1 - first_panel;
    let dst = openmp::SharedMut(packed.as_mut_ptr());
    openmp::parallel(threads.min(count), |thread, team| {
        for panel in openmp::share(count, thread, team).map(|i| first_panel + i) {
            // SAFETY: panel `panel` owns `packed[offset..offset + width * in_features]`, inside
            // the length checked above, and no other thread takes it.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    dst.get().add(panels.offset(panel)),
                    panels.width(panel) * in_features,
                )
            };
            pack_panel(src, block, dst, panels, panel);
        }
    });
    Ok(())
}

/// Row `k` of the panel is `weight[cols, k]` for the panel's columns that `block` holds: reads
/// walk the block's rows side by side and writes go straight through the panel.
fn pack_panel(src: &[f32], block: RowBlock, dst: &mut [f32], panels: Panels, panel: usize) {
    let (k_len, width) = (panels.in_features, panels.width(panel));
    let first = panel * PANEL_WIDTH;
    let cols = block.first.max(first) - first..(block.first + block.rows).min(first + width) - first;
    debug_assert_eq!(k_len * width, dst.len());
    for (k, row) in dst.chunks_exact_mut(width).enumerate() {
        for j in cols.clone() {
            row[j] = src[(first + j - block.first) * block.stride + k];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::values;

    fn packed(w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut packed = vec![f32::NAN; packed_len(n, k)];
        pack_weight(w, &mut packed, n, k, 2).unwrap();
        packed
    }

    #[test]
    fn packing_puts_every_weight_where_index_says_and_zeroes_the_padding() {
        let (n, k) = (100, 7); // two full panels and a 16-wide one with 4 real columns
        let w = values(n * k, 1);
        let p = packed(&w, n, k);
        let panels = Panels::new(n, k);
        assert_eq!((p.len(), panels.padded.div_ceil(PANEL_WIDTH), panels.width(2)), (112 * 7, 3, 16));
        for col in 0..n {
            for kk in 0..k {
                assert_eq!(p[panels.index(col, kk)], w[col * k + kk]);
            }
        }
        for col in n..112 {
            assert!((0..k).all(|kk| p[panels.index(col, kk)] == 0.0));
        }
    }

    #[test]
    fn packing_row_blocks_one_by_one_equals_packing_the_whole_weight() {
        // Blocks that start and end inside panels (q/k/v of a fused projection), read from a
        // wider buffer (a tensor-parallel rank's columns of a row-parallel weight).
        let (n, k, stride) = (130, 9, 12);
        let w = values(n * k, 14);
        let mut wide = vec![f32::NAN; n * stride];
        for r in 0..n {
            wide[r * stride..r * stride + k].copy_from_slice(&w[r * k..(r + 1) * k]);
        }
        let mut p = vec![0.0; packed_len(n, k)];
        for (first, rows) in [(0, 50), (50, 1), (51, 79)] {
            let src = &wide[first * stride..(first + rows - 1) * stride + k];
            pack_weight_rows(src, RowBlock { first, rows, stride }, &mut p, n, k, 2).unwrap();
        }
        assert_eq!(p, packed(&w, n, k));
    }

    #[test]
    fn a_row_block_outside_the_weight_is_refused() {
        let mut p = vec![0.0; packed_len(20, 4)];
        let block = RowBlock { first: 18, rows: 3, stride: 4 };
        let err = pack_weight_rows(&[0.0; 12], block, &mut p, 20, 4, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "first_row", value: 18, .. }), "{err}");
        let block = RowBlock { first: 0, rows: 3, stride: 3 };
        let err = pack_weight_rows(&[0.0; 10], block, &mut p, 20, 4, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "stride", value: 3, .. }), "{err}");
    }
}
