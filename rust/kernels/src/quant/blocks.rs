//! One GGML block to its floats: the decoders [`super::dequantize`] runs over a tensor, written to
//! be inlined one block at a time into any loop that wants a block's values (a GEMM that reads
//! quantized weights in place, later).
//!
//! The layouts are llama.cpp's (`ggml-common.h`); each function's doc gives its block's bytes.
//! Scales are f16. The arithmetic is the one `gguf.quants` (gguf-py) does, in the same order and
//! in f32 with no fused multiply-add, so the floats are equal bit for bit to what the Python
//! loader produced before these kernels: `d * q` for the symmetric formats, `d * q + m` for the
//! ones with a minimum, `(d * scale) * q - dmin * min` for the K-quants.

/// Elements in a block of the legacy formats (Q4_0 to Q8_0).
pub const QK: usize = 32;
/// Elements in a K-quant super-block.
pub const QK_K: usize = 256;

/// An IEEE half's bits as f32, exactly (subnormals, infinities and NaN payloads included).
/// Written without branches, so loops over it vectorize.
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    const MAGIC: f32 = 1.0 / 16384.0; // 2^-14: the subnormals' scale
    const SHIFTED_EXP: u32 = 0x7c00 << 13;
    let magnitude = (u32::from(h) & 0x7fff) << 13;
    let exp = magnitude & SHIFTED_EXP;
    // Rebias the exponent from 15 to 127.
    let normal = magnitude + ((127 - 15) << 23);
    // Infinity and NaN keep the maximum exponent.
    let special = normal + ((128 - 16) << 23);
    // A subnormal: let the FPU normalize it (exponent 1, then subtract the implicit one).
    let subnormal = (f32::from_bits(normal + (1 << 23)) - MAGIC).to_bits();
    let bits = if exp == SHIFTED_EXP {
        special
    } else if exp == 0 {
        subnormal
    } else {
        normal
    };
    f32::from_bits(bits | ((u32::from(h) & 0x8000) << 16))
}

/// A bfloat16's bits as f32 (the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits(u32::from(h) << 16)
}

#[inline(always)]
fn half(bytes: &[u8], at: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

/// Q4_0, 18 bytes: `d: f16`, `qs: [u8; 16]`. Element `j < 16` is the low nibble of `qs[j]`,
/// element `j + 16` its high nibble; value `d * (q - 8)`.
#[inline(always)]
pub fn q4_0(block: &[u8; 18], out: &mut [f32; QK]) {
    let d = half(block, 0);
    let (low, high) = out.split_at_mut(QK / 2);
    for ((q, lo), hi) in block[2..].iter().zip(low).zip(high) {
        *lo = d * f32::from((q & 0x0f) as i8 - 8);
        *hi = d * f32::from((q >> 4) as i8 - 8);
    }
}

/// Q4_1, 20 bytes: `d: f16`, `m: f16`, `qs: [u8; 16]` as in Q4_0; value `d * q + m`.
#[inline(always)]
pub fn q4_1(block: &[u8; 20], out: &mut [f32; QK]) {
    let (d, m) = (half(block, 0), half(block, 2));
    let (low, high) = out.split_at_mut(QK / 2);
    for ((q, lo), hi) in block[4..].iter().zip(low).zip(high) {
        *lo = d * f32::from(q & 0x0f) + m;
        *hi = d * f32::from(q >> 4) + m;
    }
}

/// The 5-bit values of a Q5 block: the nibbles of `qs` as in Q4_0, with element `i`'s fifth
/// bit at bit `i` of the little-endian `qh`.
#[inline(always)]
fn five_bits(qh: &[u8], qs: &[u8], out: &mut [u8; QK]) {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    for (j, q) in qs.iter().enumerate() {
        out[j] = (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        out[j + QK / 2] = (q >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
    }
}

/// Q5_0, 22 bytes: `d: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; value `d * (q - 16)`.
#[inline(always)]
pub fn q5_0(block: &[u8; 22], out: &mut [f32; QK]) {
    let d = half(block, 0);
    let mut q = [0u8; QK];
    five_bits(&block[2..6], &block[6..], &mut q);
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * f32::from(q as i8 - 16);
    }
}

/// Q5_1, 24 bytes: `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; value `d * q + m`.
#[inline(always)]
pub fn q5_1(block: &[u8; 24], out: &mut [f32; QK]) {
    let (d, m) = (half(block, 0), half(block, 2));
    let mut q = [0u8; QK];
    five_bits(&block[4..8], &block[8..], &mut q);
    for (o, q) in out.iter_mut().zip(q) {
        *o = d * f32::from(q) + m;
    }
}

/// Q8_0, 34 bytes: `d: f16`, `qs: [i8; 32]`; value `q * d`.
#[inline(always)]
pub fn q8_0(block: &[u8; 34], out: &mut [f32; QK]) {
    let d = half(block, 0);
    for (o, q) in out.iter_mut().zip(&block[2..]) {
        *o = f32::from(*q as i8) * d;
    }
}

/// The eight 6-bit `(scale, min)` pairs of a Q4_K/Q5_K super-block, from its 12 scale bytes:
/// bytes 0-3 hold scales 0-3 and bytes 4-7 mins 0-3 in their low six bits; scales and mins 4-7
/// take their low four bits from bytes 8-11 and their top two from the spare bits of 0-7.
#[inline(always)]
fn k_scales(s: &[u8]) -> ([f32; 8], [f32; 8]) {
    let (mut scale, mut min) = ([0.0; 8], [0.0; 8]);
    for i in 0..4 {
        scale[i] = f32::from(s[i] & 0x3f);
        min[i] = f32::from(s[i + 4] & 0x3f);
        scale[i + 4] = f32::from((s[i + 8] & 0x0f) | ((s[i] >> 2) & 0x30));
        min[i + 4] = f32::from((s[i + 8] >> 4) | ((s[i + 4] >> 2) & 0x30));
    }
    (scale, min)
}

/// Q4_K, 144 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (see `k_scales`),
/// `qs: [u8; 128]`. Sub-block `j` of 32 takes the low (even `j`) or high (odd `j`) nibbles of
/// `qs[32 * (j / 2)..][..32]`; value `(d * scale_j) * q - dmin * min_j`.
#[inline(always)]
pub fn q4_k(block: &[u8; 144], out: &mut [f32; QK_K]) {
    let (d, dmin) = (half(block, 0), half(block, 2));
    let (scale, min) = k_scales(&block[4..16]);
    let qs = &block[16..];
    for (j, sub) in out.chunks_exact_mut(QK).enumerate() {
        let (ds, dm) = (d * scale[j], dmin * min[j]);
        let shift = 4 * (j % 2);
        for (o, q) in sub.iter_mut().zip(&qs[QK * (j / 2)..][..QK]) {
            *o = ds * f32::from((q >> shift) & 0x0f) - dm;
        }
    }
}

/// Q5_K, 176 bytes: `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]`.
/// As Q4_K, with the fifth bit of sub-block `j`'s element `l` at bit `j` of `qh[l]`.
#[inline(always)]
pub fn q5_k(block: &[u8; 176], out: &mut [f32; QK_K]) {
    let (d, dmin) = (half(block, 0), half(block, 2));
    let (scale, min) = k_scales(&block[4..16]);
    let (qh, qs) = (&block[16..48], &block[48..]);
    for (j, sub) in out.chunks_exact_mut(QK).enumerate() {
        let (ds, dm) = (d * scale[j], dmin * min[j]);
        let shift = 4 * (j % 2);
        for ((o, q), h) in sub.iter_mut().zip(&qs[QK * (j / 2)..][..QK]).zip(qh) {
            let q = ((q >> shift) & 0x0f) | (((h >> j) & 1) << 4);
            *o = ds * f32::from(q) - dm;
        }
    }
}

/// Q6_K, 210 bytes: `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`. Each half
/// of 128 elements takes 64 bytes of `ql` and 32 of `qh`; its group `k` of 32 takes nibble
/// `k / 2` of `ql[32 * (k % 2)..][..32]` and bits `2k, 2k + 1` of `qh` as its top two bits.
/// Value `(d * scales[i / 16]) * (q - 32)`.
#[inline(always)]
pub fn q6_k(block: &[u8; 210], out: &mut [f32; QK_K]) {
    let d = half(block, 208);
    let (ql, qh, scales) = (&block[..128], &block[128..192], &block[192..208]);
    for (g, group) in out.chunks_exact_mut(QK).enumerate() {
        let (h, k) = (g / 4, g % 4);
        let low = &ql[64 * h + QK * (k % 2)..][..QK];
        let high = &qh[QK * h..][..QK];
        let shift = 4 * (k / 2);
        for (i, ((o, lo), hi)) in group.iter_mut().zip(low).zip(high).enumerate() {
            let q = ((lo >> shift) & 0x0f) | (((hi >> (2 * k)) & 3) << 4);
            let ds = d * f32::from(scales[(g * QK + i) / 16] as i8);
            *o = ds * f32::from(q as i8 - 32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The half's value by its definition, in f64.
    fn f16_by_definition(h: u16) -> f64 {
        let sign = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let (exp, mant) = (i32::from((h >> 10) & 0x1f), f64::from(h & 0x3ff));
        match exp {
            0 => sign * mant * 2f64.powi(-24),
            31 if mant == 0.0 => sign * f64::INFINITY,
            31 => f64::NAN,
            _ => sign * (1.0 + mant / 1024.0) * 2f64.powi(exp - 15),
        }
    }

    fn with_half(bytes: &mut [u8], at: usize, value: u16) {
        bytes[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    const HALF: u16 = 0x3800; // 0.5
    const QUARTER: u16 = 0x3400; // 0.25

    #[test]
    fn f16_converts_every_half_exactly() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h), f16_by_definition(h));
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
                // The payload moves up with the mantissa, as hardware conversion does.
                assert_eq!(got.to_bits() & 0x007f_ffff, u32::from(h & 0x3ff) << 13, "{h:#06x}");
            } else {
                assert_eq!(f64::from(got), want, "{h:#06x}");
                assert_eq!(got.is_sign_negative(), h & 0x8000 != 0, "{h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_is_the_top_half_of_an_f32() {
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc020), -2.5);
    }

    #[test]
    fn q4_0_centres_nibbles_on_eight() {
        let mut block = [0u8; 18];
        with_half(&mut block, 0, HALF);
        for j in 0..16 {
            block[2 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0.0; QK];
        q4_0(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(out[j + 16], 0.5 * (7.0 - j as f32));
        }
    }

    #[test]
    fn q4_1_adds_the_minimum() {
        let mut block = [0u8; 20];
        with_half(&mut block, 0, HALF);
        with_half(&mut block, 2, 0xbc00); // -1.0
        for j in 0..16 {
            block[4 + j] = (j as u8) | ((15 - j as u8) << 4);
        }
        let mut out = [0.0; QK];
        q4_1(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
    }

    /// A Q5 block's `qh` and `qs` holding `q[i] = (7 * i + 3) % 32`.
    fn five_bit_pattern() -> ([u8; 4], [u8; 16], [u8; QK]) {
        let q: [u8; QK] = std::array::from_fn(|i| ((7 * i + 3) % 32) as u8);
        let qh = (0..QK).fold(0u32, |bits, i| bits | (u32::from(q[i] >> 4) << i));
        let qs = std::array::from_fn(|j| (q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
        (qh.to_le_bytes(), qs, q)
    }

    #[test]
    fn q5_0_takes_the_fifth_bit_from_qh() {
        let (qh, qs, q) = five_bit_pattern();
        let mut block = [0u8; 22];
        with_half(&mut block, 0, QUARTER);
        block[2..6].copy_from_slice(&qh);
        block[6..].copy_from_slice(&qs);
        let mut out = [0.0; QK];
        q5_0(&block, &mut out);
        for i in 0..QK {
            assert_eq!(out[i], 0.25 * (f32::from(q[i]) - 16.0), "element {i}");
        }
    }

    #[test]
    fn q5_1_takes_the_fifth_bit_and_adds_the_minimum() {
        let (qh, qs, q) = five_bit_pattern();
        let mut block = [0u8; 24];
        with_half(&mut block, 0, QUARTER);
        with_half(&mut block, 2, HALF);
        block[4..8].copy_from_slice(&qh);
        block[8..].copy_from_slice(&qs);
        let mut out = [0.0; QK];
        q5_1(&block, &mut out);
        for i in 0..QK {
            assert_eq!(out[i], 0.25 * f32::from(q[i]) + 0.5, "element {i}");
        }
    }

    #[test]
    fn q8_0_scales_signed_bytes() {
        let mut block = [0u8; 34];
        with_half(&mut block, 0, HALF);
        for i in 0..QK {
            block[2 + i] = (i as i32 * 8 - 128) as i8 as u8;
        }
        let mut out = [0.0; QK];
        q8_0(&block, &mut out);
        for (i, value) in out.iter().enumerate() {
            assert_eq!(*value, 0.5 * (i as i32 * 8 - 128) as f32);
        }
    }

    /// 12 scale bytes packing `scale_j = 9 + 6j` (up to 51, so the top bits of 4-7 are used)
    /// and `min_j = 60 - 7j`.
    fn packed_k_scales() -> ([u8; 12], [u8; 8], [u8; 8]) {
        let scale: [u8; 8] = std::array::from_fn(|j| 9 + 6 * j as u8);
        let min: [u8; 8] = std::array::from_fn(|j| 60 - 7 * j as u8);
        let mut s = [0u8; 12];
        for i in 0..4 {
            s[i] = scale[i] | ((scale[i + 4] >> 4) << 6);
            s[i + 4] = min[i] | ((min[i + 4] >> 4) << 6);
            s[i + 8] = (scale[i + 4] & 0x0f) | ((min[i + 4] & 0x0f) << 4);
        }
        (s, scale, min)
    }

    #[test]
    fn k_scales_unpack_six_bit_pairs() {
        let (s, scale, min) = packed_k_scales();
        let (got_scale, got_min) = k_scales(&s);
        assert_eq!(got_scale, scale.map(f32::from));
        assert_eq!(got_min, min.map(f32::from));
    }

    #[test]
    fn q4_k_scales_each_sub_block_and_subtracts_its_minimum() {
        let (s, scale, min) = packed_k_scales();
        let mut block = [0u8; 144];
        with_half(&mut block, 0, QUARTER);
        with_half(&mut block, 2, HALF);
        block[4..16].copy_from_slice(&s);
        for (i, q) in block[16..].iter_mut().enumerate() {
            *q = (i % 16) as u8 | (((i + 5) % 16) as u8) << 4;
        }
        let mut out = [0.0; QK_K];
        q4_k(&block, &mut out);
        for (e, got) in out.iter().enumerate() {
            let (j, l) = (e / QK, e % QK);
            let byte = QK * (j / 2) + l;
            let q = if j % 2 == 0 { byte % 16 } else { (byte + 5) % 16 };
            let want = (0.25 * f32::from(scale[j])) * q as f32 - 0.5 * f32::from(min[j]);
            assert_eq!(*got, want, "element {e}");
        }
    }

    #[test]
    fn q5_k_adds_the_fifth_bit_of_its_sub_block() {
        let (s, scale, min) = packed_k_scales();
        let mut block = [0u8; 176];
        with_half(&mut block, 0, QUARTER);
        with_half(&mut block, 2, HALF);
        block[4..16].copy_from_slice(&s);
        for (l, h) in block[16..48].iter_mut().enumerate() {
            *h = (l as u8).wrapping_mul(37) ^ 0x5a;
        }
        for (i, q) in block[48..].iter_mut().enumerate() {
            *q = (i % 16) as u8 | (((i + 5) % 16) as u8) << 4;
        }
        let mut out = [0.0; QK_K];
        q5_k(&block, &mut out);
        for (e, got) in out.iter().enumerate() {
            let (j, l) = (e / QK, e % QK);
            let byte = QK * (j / 2) + l;
            let low = if j % 2 == 0 { byte % 16 } else { (byte + 5) % 16 };
            let high = usize::from((block[16 + l] >> j) & 1);
            let want = (0.25 * f32::from(scale[j])) * (low + 16 * high) as f32 - 0.5 * f32::from(min[j]);
            assert_eq!(*got, want, "element {e}");
        }
    }

    #[test]
    fn q6_k_matches_llama_cpp_element_order() {
        let mut block = [0u8; 210];
        for (i, b) in block[..192].iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(73).wrapping_add(11);
        }
        for (i, s) in block[192..208].iter_mut().enumerate() {
            *s = (i as i32 * 9 - 70) as i8 as u8;
        }
        with_half(&mut block, 208, QUARTER);
        let mut out = [0.0; QK_K];
        q6_k(&block, &mut out);
        // llama.cpp's dequantize_row_q6_K, element by element.
        let (ql, qh, sc) = (&block[..128], &block[128..192], &block[192..208]);
        for n in 0..2 {
            for l in 0..32 {
                let (ql, qh, sc) = (&ql[64 * n..], &qh[32 * n..], &sc[8 * n..]);
                let is = l / 16;
                let q = [
                    ((ql[l] & 0xf) | ((qh[l] & 3) << 4)) as i8 - 32,
                    ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32,
                    ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32,
                    ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32,
                ];
                for (k, q) in q.iter().enumerate() {
                    let want = (0.25 * f32::from(sc[is + 2 * k] as i8)) * f32::from(*q);
                    assert_eq!(out[128 * n + 32 * k + l], want, "element {}", 128 * n + 32 * k + l);
                }
            }
        }
    }
}
