//! Every GGUF block format in one shape: 32-element sub-blocks of small signed integers, each
//! with a scale per 16 elements and a minimum, so that element `i` of sub-block `j` is
//! `scale[j][i / 16] * q[j][i] + min[j]`, equal (bit for bit, same operations) to what
//! [`super::blocks`] decodes.
//!
//! This is the portable form the integer dot products are defined by: the scalar path computes
//! from it directly, and the SIMD paths (`dot::x86`) are tested against it. Building it costs a
//! few scalar operations per element, so the SIMD paths unpack blocks in registers instead.

use super::blocks::{self, QK};

/// A block as `S` sub-blocks of 32 (1 for the legacy formats, 8 for the K-quants).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Unpacked<const S: usize> {
    pub q: [[i8; QK]; S],
    pub scale: [[f32; 2]; S],
    pub min: [f32; S],
}

impl<const S: usize> Unpacked<S> {
    fn new() -> Self {
        Unpacked { q: [[0; QK]; S], scale: [[0.0; 2]; S], min: [0.0; S] }
    }

    /// Element `e` of the block as a float.
    #[cfg(test)]
    pub(crate) fn value(&self, e: usize) -> f32 {
        let (j, i) = (e / QK, e % QK);
        self.scale[j][i / 16] * f32::from(self.q[j][i]) + self.min[j]
    }
}

#[inline(always)]
fn half(bytes: &[u8], at: usize) -> f32 {
    blocks::f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Nibbles of `qs` as Q4_0 orders them (low nibbles first), less `offset`.
#[inline(always)]
fn nibbles(qs: &[u8], offset: i8, out: &mut [i8; QK]) {
    for (j, q) in qs.iter().enumerate() {
        out[j] = (q & 0x0f) as i8 - offset;
        out[j + QK / 2] = (q >> 4) as i8 - offset;
    }
}

/// Adds 16 to element `i` where bit `i` of the little-endian `qh` is set.
#[inline(always)]
fn fifth_bits(qh: &[u8], out: &mut [i8; QK]) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for (i, q) in out.iter_mut().enumerate() {
        *q += (((qh >> i) & 1) << 4) as i8;
    }
}

/// A legacy block: one sub-block with one scale and minimum.
#[inline(always)]
fn legacy(d: f32, min: f32, fill: impl FnOnce(&mut [i8; QK])) -> Unpacked<1> {
    let mut u = Unpacked::<1>::new();
    fill(&mut u.q[0]);
    u.scale[0] = [d; 2];
    u.min[0] = min;
    u
}

pub(crate) fn q4_0(b: &[u8; 18]) -> Unpacked<1> {
    legacy(half(b, 0), 0.0, |q| nibbles(&b[2..], 8, q))
}

pub(crate) fn q4_1(b: &[u8; 20]) -> Unpacked<1> {
    legacy(half(b, 0), half(b, 2), |q| nibbles(&b[4..], 0, q))
}

pub(crate) fn q5_0(b: &[u8; 22]) -> Unpacked<1> {
    // The offset comes off after the fifth bit goes on: q - 16 stays within i8 either way.
    legacy(half(b, 0), 0.0, |q| {
        nibbles(&b[6..], 0, q);
        fifth_bits(&b[2..6], q);
        q.iter_mut().for_each(|q| *q -= 16);
    })
}

pub(crate) fn q5_1(b: &[u8; 24]) -> Unpacked<1> {
    legacy(half(b, 0), half(b, 2), |q| {
        nibbles(&b[8..], 0, q);
        fifth_bits(&b[4..8], q);
    })
}

pub(crate) fn q8_0(b: &[u8; 34]) -> Unpacked<1> {
    legacy(half(b, 0), 0.0, |q| {
        for (q, b) in q.iter_mut().zip(&b[2..]) {
            *q = *b as i8;
        }
    })
}

/// The eight `(d · scale_j, -(dmin · min_j))` of a Q4_K/Q5_K block (see `blocks::k_scales`).
#[inline(always)]
pub(crate) fn k_scales(b: &[u8]) -> ([f32; 8], [f32; 8]) {
    let (d, dmin, s) = (half(b, 0), half(b, 2), &b[4..16]);
    let (mut scale, mut min) = ([0.0; 8], [0.0; 8]);
    for i in 0..4 {
        scale[i] = d * f32::from(s[i] & 0x3f);
        min[i] = -(dmin * f32::from(s[i + 4] & 0x3f));
        scale[i + 4] = d * f32::from((s[i + 8] & 0x0f) | ((s[i] >> 2) & 0x30));
        min[i + 4] = -(dmin * f32::from((s[i + 8] >> 4) | ((s[i + 4] >> 2) & 0x30)));
    }
    (scale, min)
}

pub(crate) fn q4_k(b: &[u8; 144]) -> Unpacked<8> {
    let mut u = Unpacked::<8>::new();
    let (scale, min) = k_scales(b);
    for j in 0..8 {
        let shift = 4 * (j % 2);
        for (q, byte) in u.q[j].iter_mut().zip(&b[16 + QK * (j / 2)..][..QK]) {
            *q = ((byte >> shift) & 0x0f) as i8;
        }
        (u.scale[j], u.min[j]) = ([scale[j]; 2], min[j]);
    }
    u
}

pub(crate) fn q5_k(b: &[u8; 176]) -> Unpacked<8> {
    let mut u = Unpacked::<8>::new();
    let (scale, min) = k_scales(b);
    let (qh, qs) = (&b[16..48], &b[48..]);
    for j in 0..8 {
        let shift = 4 * (j % 2);
        for ((q, byte), h) in u.q[j].iter_mut().zip(&qs[QK * (j / 2)..][..QK]).zip(qh) {
            *q = (((byte >> shift) & 0x0f) | (((h >> j) & 1) << 4)) as i8;
        }
        (u.scale[j], u.min[j]) = ([scale[j]; 2], min[j]);
    }
    u
}

pub(crate) fn q6_k(b: &[u8; 210]) -> Unpacked<8> {
    let mut u = Unpacked::<8>::new();
    let d = half(b, 208);
    let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
    for j in 0..8 {
        let (h, k) = (j / 4, j % 4);
        let low = &ql[64 * h + QK * (k % 2)..][..QK];
        let shift = 4 * (k / 2);
        for ((q, lo), hi) in u.q[j].iter_mut().zip(low).zip(&qh[QK * h..][..QK]) {
            *q = (((lo >> shift) & 0x0f) | (((hi >> (2 * k)) & 3) << 4)) as i8 - 32;
        }
        u.scale[j] = [d * f32::from(scales[2 * j] as i8), d * f32::from(scales[2 * j + 1] as i8)];
    }
    u
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::quant::GgmlType;

    /// `blocks` blocks of `ggml_type` with arbitrary bytes but finite f16 scales below 2.
    pub(crate) fn random_blocks(ggml_type: GgmlType, blocks: usize, seed: u32) -> Vec<u8> {
        let mut data: Vec<u8> = (0..blocks * ggml_type.block_bytes())
            .map(|i| (i as u32 ^ seed).wrapping_mul(2_654_435_761).rotate_right(13) as u8)
            .collect();
        let scales: &[usize] = match ggml_type {
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q6K => &[208],
            _ => &[0],
        };
        for block in data.chunks_exact_mut(ggml_type.block_bytes()) {
            for &at in scales {
                block[at + 1] &= 0x3f; // exponent below 16: finite, under 2
            }
        }
        data
    }

    fn check<const B: usize, const L: usize, const S: usize>(
        t: GgmlType,
        unpack: fn(&[u8; B]) -> Unpacked<S>,
        decode: fn(&[u8; B], &mut [f32; L]),
    ) {
        let data = random_blocks(t, 5, 1);
        for block in data.as_chunks::<B>().0 {
            let (u, mut want) = (unpack(block), [0.0; L]);
            decode(block, &mut want);
            for (e, w) in want.iter().enumerate() {
                // `==`, not bits: `d * 0 + 0.0` is +0 where the decoder's `d * 0` may be -0.
                assert_eq!(u.value(e), *w, "{t:?} element {e}");
            }
        }
    }

    #[test]
    fn every_format_rebuilds_the_decoders_values_exactly() {
        check(GgmlType::Q4_0, q4_0, blocks::q4_0);
        check(GgmlType::Q4_1, q4_1, blocks::q4_1);
        check(GgmlType::Q5_0, q5_0, blocks::q5_0);
        check(GgmlType::Q5_1, q5_1, blocks::q5_1);
        check(GgmlType::Q8_0, q8_0, blocks::q8_0);
        check(GgmlType::Q4K, q4_k, blocks::q4_k);
        check(GgmlType::Q5K, q5_k, blocks::q5_k);
        check(GgmlType::Q6K, q6_k, blocks::q6_k);
    }
}
