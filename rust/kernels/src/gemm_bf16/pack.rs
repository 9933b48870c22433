//! The bf16 GEMM's weight layout ([`PairPanels`]) and its packing, whole or one block of rows at a
//! time straight from a checkpoint tensor, as the fp32 GEMM's `pack` does. Threads take whole
//! panels.
//!
//! Panels are the fp32 GEMM's: [`PANEL_WIDTH`] output columns, the columns padded to a multiple
//! of 16. Within a panel, `in_features` is read two at a time: panel row `p` holds, for each
//! column, the 32-bit word `weight[col, 2p] | weight[col, 2p + 1] << 16` (an odd `in_features`
//! pads its last word with a zero). That word is what AVX512-BF16's `vdpbf16ps` multiplies a
//! broadcast pair of `x` with; the AVX2 and AVX-512F paths turn one load of words into the
//! even-`k` vector (shift left by 16) and the odd-`k` vector (mask off the low half), two ALU
//! operations per 2 × 8 or 2 × 16 weights.

use crate::error::{check_len, KernelError};
use crate::gemm::{RowBlock, PANEL_WIDTH};
use crate::{openmp, Bf16};

/// Columns are padded to a multiple of this: one AVX-512 vector of words.
pub(super) const PAD: usize = 16;

/// Where the panels of a packed bf16 weight sit; lengths and offsets count bf16 elements.
#[derive(Clone, Copy, Debug)]
pub(super) struct PairPanels {
    pub(super) in_features: usize,
    /// `out_features` rounded up to a multiple of [`PAD`]: the packed columns.
    pub(super) padded: usize,
    /// `in_features` rounded up to even, halved: the panel rows.
    pub(super) pairs: usize,
}

impl PairPanels {
    pub(super) fn new(out_features: usize, in_features: usize) -> Self {
        let (padded, pairs) = (out_features.div_ceil(PAD) * PAD, in_features.div_ceil(2));
        Self { in_features, padded, pairs }
    }

    pub(super) fn len(&self) -> usize {
        self.padded * self.pairs * 2
    }

    /// Columns of panel `panel`: [`PANEL_WIDTH`] but for the last; also the distance, in 32-bit
    /// words, between its rows.
    pub(super) fn width(&self, panel: usize) -> usize {
        (self.padded - panel * PANEL_WIDTH).min(PANEL_WIDTH)
    }

    /// Element index of panel `panel`'s first word; every panel before it is full width.
    pub(super) fn offset(&self, panel: usize) -> usize {
        panel * PANEL_WIDTH * self.pairs * 2
    }

    /// Element index of `weight[col, k]`.
    pub(super) fn index(&self, col: usize, k: usize) -> usize {
        let panel = col / PANEL_WIDTH;
        self.offset(panel) + ((k / 2) * self.width(panel) + col % PANEL_WIDTH) * 2 + k % 2
    }
}

/// Elements (bf16) of the packed form of an `[out_features, in_features]` weight.
pub fn packed_len_bf16(out_features: usize, in_features: usize) -> usize {
    PairPanels::new(out_features, in_features).len()
}

/// Packs `weight` (`[out_features, in_features]`, row-major) into `packed` ([`packed_len_bf16`]
/// elements) for [`gemm_bf16`](super::gemm_bf16); padding is zero.
pub fn pack_weight_bf16(
    weight: &[Bf16],
    packed: &mut [Bf16],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    check_len("weight", weight.len(), out_features * in_features)?;
    check_len("packed", packed.len(), packed_len_bf16(out_features, in_features))?;
    packed.fill(Bf16::default());
    let rows = RowBlock { first: 0, rows: out_features, stride: in_features };
    pack_weight_rows_bf16(weight, rows, packed, out_features, in_features, threads)
}

/// Packs one block of rows of an `[out_features, in_features]` weight into their columns of
/// `packed` (the whole weight's [`packed_len_bf16`] elements, zeroed beforehand so the padding
/// is zero), leaving every other element as it is: a loader packs q, k, v (or a rank's slice)
/// straight from the checkpoint, with no merged copy.
pub fn pack_weight_rows_bf16(
    src: &[Bf16],
    block: RowBlock,
    packed: &mut [Bf16],
    out_features: usize,
    in_features: usize,
    threads: usize,
) -> Result<(), KernelError> {
    let panels = PairPanels::new(out_features, in_features);
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
            // SAFETY: panel `panel` owns `packed[offset..offset + width * pairs * 2]`, inside the
            // length checked above, and no other thread takes it.
            let dst = unsafe {
                std::slice::from_raw_parts_mut(
                    dst.get().add(panels.offset(panel)),
                    panels.width(panel) * panels.pairs * 2,
                )
            };
            pack_panel(src, block, dst, panels, panel);
        }
    });
    Ok(())
}

/// Fills the words of the panel's columns that `block` holds, one panel row after another.
fn pack_panel(src: &[Bf16], block: RowBlock, dst: &mut [Bf16], panels: PairPanels, panel: usize) {
    let (k_len, width) = (panels.in_features, panels.width(panel));
    let first = panel * PANEL_WIDTH;
    let cols = block.first.max(first) - first..(block.first + block.rows).min(first + width) - first;
    for (p, row) in dst.chunks_exact_mut(width * 2).enumerate() {
        for j in cols.clone() {
            let at = (first + j - block.first) * block.stride + 2 * p;
            row[2 * j] = src[at];
            row[2 * j + 1] = if 2 * p + 1 < k_len { src[at + 1] } else { Bf16::default() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::values;
    use crate::Element;

    fn bf16s(len: usize, seed: u32) -> Vec<Bf16> {
        values(len, seed).into_iter().map(Bf16::from_f32).collect()
    }

    #[test]
    fn packing_puts_every_weight_where_index_says_and_zeroes_the_padding() {
        let (n, k) = (100, 7); // two full panels and a 16-wide one with 4 real columns; odd k
        let w = bf16s(n * k, 1);
        let mut p = vec![Bf16(0xffff); packed_len_bf16(n, k)];
        pack_weight_bf16(&w, &mut p, n, k, 2).unwrap();
        let panels = PairPanels::new(n, k);
        assert_eq!((p.len(), panels.width(2), panels.pairs), (112 * 8, 16, 4));
        for col in 0..n {
            for kk in 0..k {
                assert_eq!(p[panels.index(col, kk)], w[col * k + kk]);
            }
            assert_eq!(p[panels.index(col, k)], Bf16(0), "odd k's last word pads with zero");
        }
        for col in n..112 {
            assert!((0..k + 1).all(|kk| p[panels.index(col, kk)] == Bf16(0)));
        }
    }

    #[test]
    fn packing_row_blocks_one_by_one_equals_packing_the_whole_weight() {
        let (n, k, stride) = (130, 9, 12);
        let w = bf16s(n * k, 14);
        let mut wide = vec![Bf16(0x7fc0); n * stride];
        for r in 0..n {
            wide[r * stride..r * stride + k].copy_from_slice(&w[r * k..(r + 1) * k]);
        }
        let mut p = vec![Bf16(0); packed_len_bf16(n, k)];
        for (first, rows) in [(0, 50), (50, 1), (51, 79)] {
            let src = &wide[first * stride..(first + rows - 1) * stride + k];
            pack_weight_rows_bf16(src, RowBlock { first, rows, stride }, &mut p, n, k, 2).unwrap();
        }
        let mut whole = vec![Bf16(0); packed_len_bf16(n, k)];
        pack_weight_bf16(&w, &mut whole, n, k, 1).unwrap();
        assert_eq!(p, whole);
    }

    #[test]
    fn a_row_block_outside_the_weight_is_refused() {
        let mut p = vec![Bf16(0); packed_len_bf16(20, 4)];
        let block = RowBlock { first: 18, rows: 3, stride: 4 };
        let err = pack_weight_rows_bf16(&[Bf16(0); 12], block, &mut p, 20, 4, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "first_row", value: 18, .. }), "{err}");
        let err = pack_weight_bf16(&[Bf16(0); 80], &mut [Bf16(0); 80], 20, 4, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "packed", expected: 128, actual: 80 });
    }
}
