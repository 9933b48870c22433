//! GGML's block formats (the tensors of llama.cpp's GGUF files) to floats.
//!
//! Owns the table of formats the kernels read ([`GgmlType`]: ids, block sizes) and
//! [`dequantize`], which turns a tensor's blocks into `f32` or bf16 elements on the OpenMP team.
//! The per-block decoders live in [`blocks`], one small function per format, so a kernel that
//! computes from quantized weights can decode a block where it needs it.
//!
//! [`matmul`] computes `x · Wᵀ` from the blocks themselves, in integers against activations
//! quantized to 8 bits (`act`, `subblocks`, `dot`; see the [`matmul`](mod@matmul) module), so a
//! GGUF weight stays as the file's bytes in memory.
//!
//! Costs: one pass over the blocks and one write of the output, so it is bound by writing the
//! output (4 bytes per element against 0.5-1 read): ~7 GB/s of f32 into memory already touched on
//! the 2-core development machine. The 135M-parameter Q4_1 SmolLM2 file decodes in 0.15-0.35 s
//! into fresh tensors, most of it first touches of their pages; gguf-py's numpy took ~2 s.
//!
//! The dense quantized formats' linear layers compute from their packed weights instead:
//! [`wq`] (weight-only int4/int8 with group scales and mins: GPTQ, AWQ, compressed-tensors
//! W4A16/W8A16), [`w8a8`] (int8 × int8, VNNI where the CPU has it) and [`fp8`] (e4m3 weights
//! decoded in registers); their batches share `tiled`, which decodes a small tile at a time.

mod act;
pub mod blocks;
mod dot;
pub mod fp8;
pub mod interleaved;
pub mod matmul;
mod subblocks;
mod tiled;
pub mod w8a8;
pub mod wq;

pub use dot::Isa;
pub use matmul::{matmul, matmul_stacked, matmul_stacked_on, Activations, QuantWeight};

use crate::element::Element;
use crate::error::{check_len, KernelError};
use crate::openmp::for_each_share;
use crate::simd::multiversion;

/// Below this many blocks per thread (a 64 K-element share), waking the team costs more.
const MIN_BLOCKS_PER_THREAD: usize = 2048;

/// A GGML tensor type this module decodes. The discriminants are GGML's type ids
/// (`ggml_type` in `ggml.h`, `GGMLQuantizationType` in gguf-py).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum GgmlType {
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Bf16 = 30,
}

impl GgmlType {
    /// Every type [`dequantize`] takes.
    pub const ALL: [GgmlType; 10] = [
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Bf16,
    ];

    /// The type with GGML id `id`, if this module decodes it.
    pub fn from_id(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// Elements in one block.
    pub fn block_len(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q5_0 | Self::Q5_1 | Self::Q8_0 => blocks::QK,
            Self::Q4K | Self::Q5K | Self::Q6K => blocks::QK_K,
        }
    }

    /// Bytes of one block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F16 | Self::Bf16 => 2,
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }
}

/// Decodes `data`, whole blocks of `ggml_type`, into `out` (`block_len` elements per block).
pub fn dequantize<T: Element>(
    ggml_type: GgmlType,
    data: &[u8],
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    let (block_len, block_bytes) = (ggml_type.block_len(), ggml_type.block_bytes());
    if !data.len().is_multiple_of(block_bytes) {
        return Err(KernelError::Value {
            name: "data",
            limit: format!("whole {ggml_type:?} blocks of {block_bytes} bytes"),
            value: data.len() as i64,
        });
    }
    check_len("out", out.len(), data.len() / block_bytes * block_len)?;
    for_each_share(out, block_len, MIN_BLOCKS_PER_THREAD, threads, |blocks, out| {
        decode_run::<T>(ggml_type, &data[blocks.start * block_bytes..blocks.end * block_bytes], out);
    });
    Ok(())
}

/// Rows `ids` of a `[rows, row_len]` tensor of `ggml_type` blocks (row `n` from byte `n ·
/// row_stride` of `data`), decoded into `out` (`[ids.len(), row_len]`, `row_len = out.len() /
/// ids.len()`): an embedding lookup straight from a GGUF file's table.
///
/// # Errors
/// A `row_len` that is not whole blocks, a `row_stride` shorter than a row, or an id outside
/// the table (nothing is written then).
pub fn dequantize_rows<T: Element>(
    ggml_type: GgmlType,
    data: &[u8],
    row_stride: usize,
    ids: &[i64],
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    let (block_len, block_bytes) = (ggml_type.block_len(), ggml_type.block_bytes());
    let row_len = if ids.is_empty() { 0 } else { out.len() / ids.len() };
    check_len("out", out.len(), ids.len() * row_len)?;
    if !row_len.is_multiple_of(block_len) {
        let limit = format!("whole {ggml_type:?} blocks of {block_len} elements");
        return Err(KernelError::Value { name: "row_len", limit, value: row_len as i64 });
    }
    let row_bytes = row_len / block_len * block_bytes;
    if row_stride < row_bytes {
        let limit = format!("at least a row's {row_bytes} bytes");
        return Err(KernelError::Value { name: "row_stride", limit, value: row_stride as i64 });
    }
    let rows = if data.len() < row_bytes { 0 } else { (data.len() - row_bytes) / row_stride + 1 };
    if let Some(&id) = ids.iter().find(|&&id| id < 0 || id as usize >= rows) {
        return Err(KernelError::Value {
            name: "ids",
            limit: format!("in 0..{rows} (the table's rows)"),
            value: id,
        });
    }
    for_each_share(out, row_len, MIN_ROWS_PER_THREAD, threads, |range, out| {
        for (&id, out) in ids[range].iter().zip(out.chunks_exact_mut(row_len.max(1))) {
            decode_run::<T>(ggml_type, &data[id as usize * row_stride..][..row_bytes], out);
        }
    });
    Ok(())
}

/// Rows of a lookup per thread, at least: a decode step's one row runs on the calling thread.
const MIN_ROWS_PER_THREAD: usize = 64;

multiversion!(fn decode_run<T>(ggml_type: GgmlType, data: &[u8], out: &mut [T]) => decode_run_body);

#[inline(always)]
fn decode_run_body<T: Element>(ggml_type: GgmlType, data: &[u8], out: &mut [T]) {
    match ggml_type {
        GgmlType::F16 => each_element(data, out, blocks::f16_to_f32),
        GgmlType::Bf16 => each_element(data, out, blocks::bf16_to_f32),
        GgmlType::Q4_0 => each_block(data, out, blocks::q4_0),
        GgmlType::Q4_1 => each_block(data, out, blocks::q4_1),
        GgmlType::Q5_0 => each_block(data, out, blocks::q5_0),
        GgmlType::Q5_1 => each_block(data, out, blocks::q5_1),
        GgmlType::Q8_0 => each_block(data, out, blocks::q8_0),
        GgmlType::Q4K => each_block(data, out, blocks::q4_k),
        GgmlType::Q5K => each_block(data, out, blocks::q5_k),
        GgmlType::Q6K => each_block(data, out, blocks::q6_k),
    }
}

/// Runs `decode` over consecutive `BYTES`-byte blocks into `LEN`-element pieces of `out`.
#[inline(always)]
fn each_block<T: Element, const BYTES: usize, const LEN: usize>(
    data: &[u8],
    out: &mut [T],
    decode: impl Fn(&[u8; BYTES], &mut [f32; LEN]),
) {
    let mut values = [0.0f32; LEN];
    let (blocks, _) = data.as_chunks::<BYTES>();
    for (block, out) in blocks.iter().zip(out.chunks_exact_mut(LEN)) {
        decode(block, &mut values);
        for (o, v) in out.iter_mut().zip(values) {
            *o = T::from_f32(v);
        }
    }
}

/// Converts consecutive little-endian 16-bit floats.
#[inline(always)]
fn each_element<T: Element>(data: &[u8], out: &mut [T], convert: impl Fn(u16) -> f32) {
    let (halves, _) = data.as_chunks::<2>();
    for (o, h) in out.iter_mut().zip(halves) {
        *o = T::from_f32(convert(u16::from_le_bytes(*h)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Bf16;

    /// `blocks` blocks of `ggml_type` with arbitrary bytes but finite f16 scales.
    fn random_blocks(ggml_type: GgmlType, blocks: usize) -> Vec<u8> {
        let mut data: Vec<u8> = (0..blocks * ggml_type.block_bytes())
            .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
            .collect();
        for block in data.chunks_exact_mut(ggml_type.block_bytes()) {
            // Clear the top exponent bit of every half (no infinities or NaN scales).
            let scales: &[usize] = match ggml_type {
                GgmlType::F16 | GgmlType::Bf16 => &[0],
                GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
                GgmlType::Q6K => &[208],
            };
            for &at in scales {
                block[at + 1] &= 0xbf;
            }
        }
        data
    }

    fn serial(ggml_type: GgmlType, data: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; data.len() / ggml_type.block_bytes() * ggml_type.block_len()];
        decode_run_body::<f32>(ggml_type, data, &mut out);
        out
    }

    #[test]
    fn type_ids_round_trip() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_id(t as u32), Some(t));
        }
        assert_eq!(GgmlType::from_id(0), None, "F32 needs no decoding");
        assert_eq!(GgmlType::from_id(10), None, "Q2_K is not decoded here");
    }

    #[test]
    fn every_type_decodes_its_blocks_in_order() {
        for t in GgmlType::ALL {
            let data = random_blocks(t, 3);
            let mut out = vec![0.0f32; 3 * t.block_len()];
            dequantize(t, &data, &mut out, 1).unwrap();
            let last = &data[2 * t.block_bytes()..];
            assert_eq!(out[2 * t.block_len()..], serial(t, last)[..], "{t:?}");
            assert!(out.iter().all(|v| v.is_finite()), "{t:?}");
        }
    }

    #[test]
    fn f16_tensor_converts_each_half() {
        let data = [0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00];
        let mut out = [0.0f32; 3];
        dequantize(GgmlType::F16, &data, &mut out, 1).unwrap();
        assert_eq!(out, [1.0, -2.0, 2f32.powi(-24)]);
    }

    #[test]
    fn bf16_output_is_the_f32_output_rounded() {
        let data = random_blocks(GgmlType::Q4K, 4);
        let want = serial(GgmlType::Q4K, &data);
        let mut out = vec![Bf16(0); want.len()];
        dequantize(GgmlType::Q4K, &data, &mut out, 1).unwrap();
        for (o, w) in out.iter().zip(&want) {
            assert_eq!(*o, Bf16::from_f32(*w));
        }
    }

    #[test]
    fn a_team_gives_the_serial_result() {
        // The test binary has no OpenMP runtime, so this checks the split; the Python tests run it on torch's team.
        let data = random_blocks(GgmlType::Q6K, 3 * MIN_BLOCKS_PER_THREAD + 5);
        let mut out = vec![0.0f32; data.len() / 210 * 256];
        dequantize(GgmlType::Q6K, &data, &mut out, 4).unwrap();
        assert_eq!(out, serial(GgmlType::Q6K, &data));
    }

    #[test]
    fn a_lookup_decodes_the_rows_asked_for_in_their_order() {
        // Four rows of two Q4_K blocks, 8 bytes of padding after each (a strided view).
        let (t, stride) = (GgmlType::Q4K, 2 * 144 + 8);
        let rows = random_blocks(t, 8);
        let mut table = vec![0u8; 4 * stride];
        for (r, row) in rows.chunks_exact(2 * 144).enumerate() {
            table[r * stride..][..2 * 144].copy_from_slice(row);
        }
        let mut out = vec![0.0f32; 3 * 512];
        dequantize_rows(t, &table[..3 * stride + 2 * 144], stride, &[3, 0, 3], &mut out, 2).unwrap();
        let row = |r: usize| serial(t, &rows[r * 288..(r + 1) * 288]);
        assert_eq!(out, [row(3), row(0), row(3)].concat());
        let err = dequantize_rows(t, &table, stride, &[4], &mut out[..512], 1).unwrap_err();
        assert!(err.to_string().contains("in 0..4"), "{err}");
        let err = dequantize_rows(t, &table, stride, &[-1], &mut out[..512], 1).unwrap_err();
        assert!(err.to_string().contains("ids"), "{err}");
        let err = dequantize_rows(t, &table, 100, &[0], &mut out[..512], 1).unwrap_err();
        assert!(err.to_string().contains("row_stride"), "{err}");
        let err = dequantize_rows(t, &table, stride, &[0, 1], &mut out[..300], 1).unwrap_err();
        assert!(err.to_string().contains("row_len"), "{err}");
    }

    #[test]
    fn partial_blocks_and_short_outputs_are_refused() {
        let mut out = vec![0.0f32; 32];
        let err = dequantize(GgmlType::Q4_0, &[0u8; 19], &mut out, 1).unwrap_err();
        assert!(err.to_string().contains("whole Q4_0 blocks of 18 bytes"), "{err}");
        let err = dequantize(GgmlType::Q4_0, &[0u8; 36], &mut out, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "out", expected: 64, actual: 32 });
    }
}
