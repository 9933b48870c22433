//! GGUF Q4_0, Q4_1 and Q8_0 weights re-laid at load so one vector instruction serves 16 weight
//! rows ([`GROUP`]) instead of one.
//!
//! In the file's layout (read by [`super::dot`]) every 32-element block of every row pays its own
//! unpacking, integer dot, conversion and scaling: ~16 instructions per block and activation row,
//! which held a Q4_0 decode step on 2 cores to ~10 GB/s, half the memory bandwidth (Qwen2-0.5B
//! Q4_0 at 0.83x llama.cpp, whose CPU backend also re-lays Q4_0 at load). Here the rows go in
//! groups of 16 and, per block, the group's bytes are laid so that 32-bit lane `r` of a 512-bit
//! vector holds four consecutive values of row `r`: one `vpdpbusd` against four activation bytes
//! broadcast to every lane advances all 16 rows, and the scaling is one vector of 16 scales.
//!
//! A group's block `b` (all [`GROUP`] rows' block `b`, back to back by `b` within the group,
//! groups back to back; the last group padded with zero rows):
//!
//! - the 16 rows' f16 scales `d` (32 bytes), then for Q4_1 their f16 minimums `m` (32 bytes);
//! - Q4_0, Q4_1: four 64-byte chunks; byte `4r + j` of chunk `c` holds row `r`'s element
//!   `8c + j` in its low nibble and `8c + 4 + j` in its high one;
//! - Q8_0: eight 64-byte chunks; byte `4r + j` of chunk `c` is row `r`'s element `4c + j` plus
//!   128, as an unsigned byte (`vpdpbusd` multiplies unsigned by signed bytes).
//!
//! So a group holds exactly the file's bytes for its rows, reordered: memory stays the file's
//! size. Products sum integers exactly per block (`Σ u·xq`, minus `8·Σxq` for Q4_0's offset and
//! `128·Σxq` for Q8_0's), then `acc += (d · d_x) · sum` (`+ m · d_x Σxq` for Q4_1) in f32: the
//! portable loop and the AVX512-VNNI one do the same operations in the same order, so they agree
//! bit for bit.

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(test)]
mod tests;

use super::act::{Row, BLOCK};
use super::dot::Isa;
use super::GgmlType;
use crate::KernelError;

/// Weight rows per group.
pub const GROUP: usize = 16;

/// How one of the re-laid formats stores a group's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Format {
    pub(crate) fn of(t: GgmlType) -> Option<Format> {
        match t {
            GgmlType::Q4_0 => Some(Format::Q4_0),
            GgmlType::Q4_1 => Some(Format::Q4_1),
            GgmlType::Q8_0 => Some(Format::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one row's block in the file.
    const fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
        }
    }

    /// Bytes of the scales (and minimums) ahead of a group block's values.
    pub(crate) const fn scale_bytes(self) -> usize {
        match self {
            Format::Q4_1 => 4 * GROUP,
            _ => 2 * GROUP,
        }
    }

    /// Bytes of a group's block: the file's bytes for its 16 rows.
    pub(crate) const fn group_block_bytes(self) -> usize {
        GROUP * self.block_bytes()
    }

    /// What each row's integer sum loses to the stored offset, per unit of `Σxq`.
    pub(crate) const fn offset(self) -> i32 {
        match self {
            Format::Q4_0 => 8,
            Format::Q4_1 => 0,
            Format::Q8_0 => 128,
        }
    }

    /// Element `e` of a file block as the byte the products multiply: 0..=15 for 4-bit
    /// formats, the signed value plus 128 for Q8_0.
    fn value(self, block: &[u8], e: usize) -> u8 {
        match self {
            Format::Q8_0 => block[2 + e] ^ 0x80,
            _ => {
                let qs = &block[self.block_bytes() - 16..];
                if e < 16 {
                    qs[e] & 0x0f
                } else {
                    qs[e - 16] >> 4
                }
            }
        }
    }

    /// Byte `e`'s place in a group block's values for row `r`, and whether it is the high nibble.
    fn place(self, r: usize, e: usize) -> (usize, bool) {
        match self {
            Format::Q8_0 => (64 * (e / 4) + 4 * r + e % 4, false),
            _ => (64 * (e / 8) + 4 * r + e % 4, e % 8 >= 4),
        }
    }

    /// Row `r`'s element `e` as the products multiply it, read back from a group block's values.
    fn stored(self, values: &[u8], r: usize, e: usize) -> u8 {
        let (at, high) = self.place(r, e);
        match (self, high) {
            (Format::Q8_0, _) => values[at],
            (_, true) => values[at] >> 4,
            (_, false) => values[at] & 0x0f,
        }
    }
}

/// Whether [`interleave`] takes `ggml_type`.
pub fn supported(ggml_type: GgmlType) -> bool {
    Format::of(ggml_type).is_some()
}

/// Whether re-laying `ggml_type` pays on this CPU: it has AVX512-VNNI, where the group product
/// runs on vectors (elsewhere only the portable loop computes from groups).
pub fn preferred(ggml_type: GgmlType) -> bool {
    supported(ggml_type) && Isa::detect() == Isa::Avx512Vnni
}

/// Bytes of an `[out_features, in_features]` weight of `ggml_type` once interleaved.
pub fn interleaved_len(ggml_type: GgmlType, out_features: usize, in_features: usize) -> usize {
    Format::of(ggml_type)
        .map_or(0, |f| out_features.div_ceil(GROUP) * in_features / BLOCK * f.group_block_bytes())
}

/// Checks a format and shape; returns the format and blocks per row.
fn checked(ggml_type: GgmlType, in_features: usize) -> Result<(Format, usize), KernelError> {
    let Some(format) = Format::of(ggml_type) else {
        return Err(KernelError::Value {
            name: "ggml_type",
            limit: "Q4_0, Q4_1 or Q8_0 (the formats with an interleaved layout)".into(),
            value: ggml_type as i64,
        });
    };
    if !in_features.is_multiple_of(BLOCK) {
        return Err(KernelError::Value {
            name: "in_features",
            limit: format!("a multiple of {BLOCK}"),
            value: in_features as i64,
        });
    }
    Ok((format, in_features / BLOCK))
}

fn check_bytes(name: &'static str, given: usize, needed: usize) -> Result<(), KernelError> {
    if given < needed {
        return Err(KernelError::Value {
            name,
            limit: format!("at least {needed} bytes"),
            value: given as i64,
        });
    }
    Ok(())
}

/// Re-lays `out_features` rows of `ggml_type` blocks (row `n` at byte `n · row_stride` of `rows`)
/// into `dst` ([`interleaved_len`] bytes; padding rows are written as zeros).
pub fn interleave(
    ggml_type: GgmlType,
    rows: &[u8],
    row_stride: usize,
    out_features: usize,
    in_features: usize,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    let (format, blocks) = checked(ggml_type, in_features)?;
    let row_bytes = blocks * format.block_bytes();
    check_bytes("rows", rows.len(), out_features.saturating_sub(1) * row_stride + row_bytes)?;
    check_bytes("dst", dst.len(), interleaved_len(ggml_type, out_features, in_features))?;
    for (g, group) in dst.chunks_exact_mut(blocks * format.group_block_bytes()).enumerate() {
        group.fill(0);
        for r in 0..GROUP.min(out_features.saturating_sub(g * GROUP)) {
            let row = &rows[(g * GROUP + r) * row_stride..][..row_bytes];
            for (block, dst) in
                row.chunks_exact(format.block_bytes()).zip(group.chunks_exact_mut(format.group_block_bytes()))
            {
                put_block(format, block, r, dst);
            }
        }
    }
    Ok(())
}

/// Row `r`'s file block into a group block (its other rows' bytes are left as they are).
fn put_block(format: Format, block: &[u8], r: usize, dst: &mut [u8]) {
    dst[2 * r..2 * r + 2].copy_from_slice(&block[..2]);
    if format == Format::Q4_1 {
        dst[2 * GROUP + 2 * r..][..2].copy_from_slice(&block[2..4]);
    }
    let v: [u8; BLOCK] = std::array::from_fn(|e| format.value(block, e));
    let values = &mut dst[format.scale_bytes()..];
    // The byte order `place` describes, written a chunk at a time.
    match format {
        Format::Q8_0 => {
            (0..8).for_each(|c| values[64 * c + 4 * r..][..4].copy_from_slice(&v[4 * c..4 * c + 4]))
        }
        _ => {
            for c in 0..4 {
                for j in 0..4 {
                    values[64 * c + 4 * r + j] = v[8 * c + j] | v[8 * c + 4 + j] << 4;
                }
            }
        }
    }
}

/// The inverse of [`interleave`]: the `out_features` rows back in the file's layout, back to
/// back in `dst`.
pub fn deinterleave(
    ggml_type: GgmlType,
    src: &[u8],
    out_features: usize,
    in_features: usize,
    dst: &mut [u8],
) -> Result<(), KernelError> {
    let (format, blocks) = checked(ggml_type, in_features)?;
    let row_bytes = blocks * format.block_bytes();
    check_bytes("src", src.len(), interleaved_len(ggml_type, out_features, in_features))?;
    check_bytes("dst", dst.len(), out_features * row_bytes)?;
    for (n, row) in dst.chunks_exact_mut(row_bytes).take(out_features).enumerate() {
        let group = &src[n / GROUP * blocks * format.group_block_bytes()..];
        for (b, block) in row.chunks_exact_mut(format.block_bytes()).enumerate() {
            take_block(
                format,
                &group[b * format.group_block_bytes()..][..format.group_block_bytes()],
                n % GROUP,
                block,
            );
        }
    }
    Ok(())
}

/// Row `r`'s file block out of a group block.
fn take_block(format: Format, src: &[u8], r: usize, block: &mut [u8]) {
    block[..2].copy_from_slice(&src[2 * r..2 * r + 2]);
    if format == Format::Q4_1 {
        block[2..4].copy_from_slice(&src[2 * GROUP + 2 * r..][..2]);
    }
    let values = &src[format.scale_bytes()..];
    let value = |e: usize| format.stored(values, r, e);
    match format {
        Format::Q8_0 => (0..BLOCK).for_each(|e| block[2 + e] = value(e) ^ 0x80),
        _ => {
            let first = format.block_bytes() - 16;
            (0..16).for_each(|i| block[first + i] = value(i) | value(i + 16) << 4);
        }
    }
}

/// A compiled group product: a group's `blocks` blocks (from its first byte) against `M` rows
/// of quantized activations; `[row][lane]` sums, lane `r` being the group's row `r`.
///
/// # Safety
/// `group` addresses `blocks` whole group blocks of the format it was picked for; each row holds
/// `blocks` activation blocks; the CPU has the instructions of the [`Isa`] it was picked for.
pub(crate) type GroupDot<const M: usize> = unsafe fn(*const u8, usize, &[Row<'_>; M]) -> [[f32; GROUP]; M];

/// The group product for `format` with `M` rows on `isa` (the vector one on AVX512-VNNI, else
/// the portable loop).
pub(crate) fn group_dot<const M: usize>(format: Format, isa: Isa) -> GroupDot<M> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        return match format {
            Format::Q4_0 => avx512::group_dot::<avx512::Q4_0, M>,
            Format::Q4_1 => avx512::group_dot::<avx512::Q4_1, M>,
            Format::Q8_0 => avx512::group_dot::<avx512::Q8_0, M>,
        };
    }
    let _ = isa;
    match format {
        Format::Q4_0 => portable::<{ Format::Q4_0 as u8 }, M>,
        Format::Q4_1 => portable::<{ Format::Q4_1 as u8 }, M>,
        Format::Q8_0 => portable::<{ Format::Q8_0 as u8 }, M>,
    }
}

const fn format_of(id: u8) -> Format {
    match id {
        0 => Format::Q4_0,
        1 => Format::Q4_1,
        _ => Format::Q8_0,
    }
}

/// `Σq` of row `x`'s block `b`, from its two 16-element sums.
#[inline(always)]
pub(crate) fn block_sum(x: &Row<'_>, b: usize) -> i32 {
    i32::from(x.sum16[2 * b]) + i32::from(x.sum16[2 * b + 1])
}

/// The portable group product (an `unsafe fn` only to share [`GroupDot`]'s type).
unsafe fn portable<const F: u8, const M: usize>(
    group: *const u8,
    blocks: usize,
    xs: &[Row<'_>; M],
) -> [[f32; GROUP]; M] {
    let format = format_of(F);
    let bytes = format.group_block_bytes();
    // SAFETY: the caller passes `blocks` whole group blocks.
    let group = unsafe { std::slice::from_raw_parts(group, blocks * bytes) };
    let mut acc = [[0.0f32; GROUP]; M];
    for (b, gb) in group.chunks_exact(bytes).enumerate() {
        let half = |at: usize| super::blocks::f16_to_f32(u16::from_le_bytes([gb[at], gb[at + 1]]));
        let values = &gb[format.scale_bytes()..];
        for (x, acc) in xs.iter().zip(acc.iter_mut()) {
            let xq = &x.q[b * BLOCK..][..BLOCK];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut sum: i32 =
                    (0..BLOCK).map(|e| i32::from(format.stored(values, r, e)) * i32::from(xq[e])).sum();
                sum -= format.offset() * block_sum(x, b);
                *acc = (sum as f32).mul_add(half(2 * r) * x.d[b], *acc);
                if format == Format::Q4_1 {
                    *acc = half(2 * GROUP + 2 * r).mul_add(x.sum[b], *acc);
                }
            }
        }
    }
    acc
}
