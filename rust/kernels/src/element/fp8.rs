//! The two 8-bit float formats of an fp8 KV cache (vLLM's `kv_cache_dtype="fp8_e4m3"` and
//! `"fp8_e5m2"`), bit for bit as torch's `float8_e4m3fn` and `float8_e5m2` store them.
//!
//! Decoding needs no table and no F16C: the byte's magnitude bits shifted into an f32's exponent
//! and mantissa, plus the difference of the exponent biases, are the f32's bits for every normal
//! value; the few subnormal codes are their integer mantissa times a power of two. (Shifting and
//! then multiplying by a power of two would be shorter, but its intermediate f32 subnormals cost
//! a microcode assist each: ~50% of the decode kernel's time on random keys here.)
//! Encoding rounds to nearest even and saturates at the largest finite value, as vLLM's cache
//! kernels convert (`SATFINITE`): a key past the range becomes ±max, not NaN or infinity.
//! Costs: decode is 4 integer ops and a multiply; encode about 20 scalar ops per element.

use super::Element;

/// One float8 e4m3fn value (4 exponent bits, bias 7, 3 mantissa bits, no infinities; `0x7f`
/// and `0xff` are NaN), torch's `torch.float8_e4m3fn` layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E4m3(pub u8);

/// One float8 e5m2 value (5 exponent bits, bias 15, 2 mantissa bits, IEEE infinities and NaNs),
/// torch's `torch.float8_e5m2` layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Fp8E5m2(pub u8);

/// Format constants shared by the scalar and SIMD conversions.
pub(crate) mod format {
    /// e4m3: magnitude bits shifted by this land in an f32's exponent and mantissa.
    pub const E4M3_SHIFT: u32 = 20;
    /// Added to the shifted bits: the exponent bias difference, `127 - 7`, in place.
    pub const E4M3_REBIAS: u32 = 120 << 23;
    /// Magnitudes below this are subnormal: `mag * 2^-9`.
    pub const E4M3_MIN_NORMAL: u32 = 0x08;
    pub const E4M3_SUBNORMAL_UNIT: f32 = 1.0 / 512.0;
    pub const E4M3_MAX: f32 = 448.0;
    pub const E5M2_SHIFT: u32 = 21;
    pub const E5M2_REBIAS: u32 = 112 << 23;
    /// Magnitudes below this are subnormal: `mag * 2^-16`.
    pub const E5M2_MIN_NORMAL: u32 = 0x04;
    pub const E5M2_SUBNORMAL_UNIT: f32 = 1.0 / 65536.0;
    pub const E5M2_MAX: f32 = 57344.0;
}
use format::*;

impl Element for Fp8E4m3 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let mag = u32::from(self.0 & 0x7f);
        let sign = u32::from(self.0 & 0x80) << 24;
        if mag == 0x7f {
            return f32::from_bits(sign | 0x7fc0_0000);
        }
        if mag < E4M3_MIN_NORMAL {
            return f32::from_bits(sign | (mag as f32 * E4M3_SUBNORMAL_UNIT).to_bits());
        }
        f32::from_bits(sign | ((mag << E4M3_SHIFT) + E4M3_REBIAS))
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        Fp8E4m3(encode(value, 3, 7, E4M3_MAX, 0x7f))
    }
}

impl Element for Fp8E5m2 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        let mag = u32::from(self.0 & 0x7f);
        let sign = u32::from(self.0 & 0x80) << 24;
        if mag >= 0x7c {
            // Infinity (mantissa 0) or NaN, as the IEEE half whose top byte this is.
            return f32::from_bits(sign | 0x7f80_0000 | (mag & 3) << E5M2_SHIFT);
        }
        if mag < E5M2_MIN_NORMAL {
            return f32::from_bits(sign | (mag as f32 * E5M2_SUBNORMAL_UNIT).to_bits());
        }
        f32::from_bits(sign | ((mag << E5M2_SHIFT) + E5M2_REBIAS))
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        Fp8E5m2(encode(value, 2, 15, E5M2_MAX, 0x7f))
    }
}

/// `value` rounded to the nearest format value (ties to even), saturated at `±max`; `nan`
/// (with the sign) for NaN. `man_bits` mantissa bits, exponent `bias`.
#[inline(always)]
fn encode(value: f32, man_bits: u32, bias: i32, max: f32, nan: u8) -> u8 {
    let sign = ((value.to_bits() >> 24) & 0x80) as u8;
    if value.is_nan() {
        return sign | nan;
    }
    let a = value.abs().min(max);
    let min_normal_exp = 1 - bias;
    // The spacing of format values around `a`: a power of two, so `a / quantum` is exact.
    let exp = if a == 0.0 { min_normal_exp } else { (a.to_bits() >> 23) as i32 - 127 };
    let quantum_exp = exp.max(min_normal_exp) - man_bits as i32;
    let q = (a * pow2(-quantum_exp)).round_ties_even();
    let rounded = q * pow2(quantum_exp);
    if rounded == 0.0 {
        return sign;
    }
    let r_exp = (rounded.to_bits() >> 23) as i32 - 127;
    let magnitude = if r_exp < min_normal_exp {
        q as u32 // a subnormal: exponent field 0, the multiple of the smallest quantum
    } else {
        let mantissa = (rounded.to_bits() >> (23 - man_bits)) & ((1 << man_bits) - 1);
        ((r_exp + bias) as u32) << man_bits | mantissa
    };
    sign | magnitude as u8
}

/// `2^e` for the exponents encoding needs (well inside f32's normal range).
#[inline(always)]
fn pow2(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// Eight (AVX2) or sixteen (AVX-512) values widened to f32 lanes, as the scalar `to_f32` does.
#[cfg(target_arch = "x86_64")]
mod lanes {
    use std::arch::x86_64::*;

    use super::{format::*, Fp8E4m3, Fp8E5m2};
    use crate::simd::Lanes;

    impl Lanes for Fp8E4m3 {
        const WIDENS: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load8(ptr: *const Self) -> __m256 {
            let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(ptr.cast::<__m128i>()));
            let mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
            let v = widen8(x, mag, E4M3_SHIFT as i32, E4M3_REBIAS, E4M3_MIN_NORMAL, E4M3_SUBNORMAL_UNIT);
            let nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
            _mm256_blendv_ps(v, _mm256_set1_ps(f32::NAN), nan)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const Self) -> __m512 {
            let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(ptr.cast::<__m128i>()));
            let mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
            let v = widen16(x, mag, E4M3_SHIFT, E4M3_REBIAS, E4M3_MIN_NORMAL, E4M3_SUBNORMAL_UNIT);
            let nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
            _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(f32::NAN))
        }
    }

    impl Lanes for Fp8E5m2 {
        const WIDENS: bool = true;
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn load8(ptr: *const Self) -> __m256 {
            let x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(ptr.cast::<__m128i>()));
            let mag = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
            let v = widen8(x, mag, E5M2_SHIFT as i32, E5M2_REBIAS, E5M2_MIN_NORMAL, E5M2_SUBNORMAL_UNIT);
            // Infinities and NaNs keep their mantissa bits in an f32 whose exponent is all ones.
            let low = _mm256_sll_epi32(
                _mm256_and_si256(mag, _mm256_set1_epi32(3)),
                _mm_cvtsi32_si128(E5M2_SHIFT as i32),
            );
            let special = _mm256_or_si256(_mm256_or_si256(low, sign8(x)), _mm256_set1_epi32(0x7f80_0000));
            let is_special = _mm256_castsi256_ps(_mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7b)));
            _mm256_blendv_ps(v, _mm256_castsi256_ps(special), is_special)
        }
        #[inline]
        #[target_feature(enable = "avx512f")]
        unsafe fn load16(ptr: *const Self) -> __m512 {
            let x = _mm512_cvtepu8_epi32(_mm_loadu_si128(ptr.cast::<__m128i>()));
            let mag = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
            let v = widen16(x, mag, E5M2_SHIFT, E5M2_REBIAS, E5M2_MIN_NORMAL, E5M2_SUBNORMAL_UNIT);
            let low = _mm512_slli_epi32::<{ E5M2_SHIFT }>(_mm512_and_si512(mag, _mm512_set1_epi32(3)));
            let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(x, _mm512_set1_epi32(0x80)));
            let special = _mm512_or_si512(_mm512_or_si512(low, sign), _mm512_set1_epi32(0x7f80_0000));
            let is_special = _mm512_cmpgt_epi32_mask(mag, _mm512_set1_epi32(0x7b));
            _mm512_mask_blend_ps(is_special, v, _mm512_castsi512_ps(special))
        }
    }

    /// The sign bit of each byte lane, moved to the f32's.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn sign8(x: __m256i) -> __m256i {
        _mm256_slli_epi32::<24>(_mm256_and_si256(x, _mm256_set1_epi32(0x80)))
    }

    /// The finite values of either format: `(mag << shift) + rebias` as f32 bits for normal
    /// magnitudes, `mag * unit` below `min_normal`, with the sign.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn widen8(
        x: __m256i,
        mag: __m256i,
        shift: i32,
        rebias: u32,
        min_normal: u32,
        unit: f32,
    ) -> __m256 {
        let shifted = _mm256_sll_epi32(mag, _mm_cvtsi32_si128(shift));
        let normal = _mm256_castsi256_ps(_mm256_add_epi32(shifted, _mm256_set1_epi32(rebias as i32)));
        let subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(unit));
        let is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(min_normal as i32), mag));
        let v = _mm256_blendv_ps(normal, subnormal, is_subnormal);
        _mm256_or_ps(v, _mm256_castsi256_ps(sign8(x)))
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn widen16(
        x: __m512i,
        mag: __m512i,
        shift: u32,
        rebias: u32,
        min_normal: u32,
        unit: f32,
    ) -> __m512 {
        let shifted = _mm512_sllv_epi32(mag, _mm512_set1_epi32(shift as i32));
        let normal = _mm512_castsi512_ps(_mm512_add_epi32(shifted, _mm512_set1_epi32(rebias as i32)));
        let subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(unit));
        let is_subnormal = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(min_normal as i32));
        let v = _mm512_mask_blend_ps(is_subnormal, normal, subnormal);
        let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(x, _mm512_set1_epi32(0x80)));
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The format's value from its definition, independently of the bit trick.
    fn by_definition(byte: u8, man_bits: u32, bias: i32) -> f32 {
        let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
        let exp = i32::from((byte & 0x7f) >> man_bits);
        let man = f64::from(byte & ((1 << man_bits) - 1));
        let frac = man / f64::from(1u32 << man_bits);
        let v = if exp == 0 { frac * 2f64.powi(1 - bias) } else { (1.0 + frac) * 2f64.powi(exp - bias) };
        (sign * v) as f32
    }

    #[test]
    fn every_e4m3_code_decodes_to_its_value_and_encodes_back() {
        for b in 0..=255u8 {
            let v = Fp8E4m3(b).to_f32();
            if b & 0x7f == 0x7f {
                assert!(v.is_nan(), "{b:#x}");
                assert!(Fp8E4m3::from_f32(v).to_f32().is_nan());
                continue;
            }
            assert_eq!(v, by_definition(b, 3, 7), "{b:#x}");
            assert_eq!(Fp8E4m3::from_f32(v).0, b, "{b:#x} -> {v}");
        }
    }

    #[test]
    fn every_e5m2_code_decodes_to_its_value_and_encodes_back() {
        for b in 0..=255u8 {
            let v = Fp8E5m2(b).to_f32();
            match b & 0x7f {
                0x7c => assert_eq!(v.abs(), f32::INFINITY),
                0x7d..=0x7f => assert!(v.is_nan(), "{b:#x}"),
                _ => {
                    assert_eq!(v, by_definition(b, 2, 15), "{b:#x}");
                    assert_eq!(Fp8E5m2::from_f32(v).0, b, "{b:#x} -> {v}");
                }
            }
        }
    }

    /// The SIMD loads of every code (each code once per lane position) against `to_f32`.
    #[cfg(target_arch = "x86_64")]
    fn check_lanes<T: crate::simd::Lanes + std::fmt::Debug>(make: fn(u8) -> T) {
        use std::arch::x86_64::*;
        let codes: Vec<T> = (0..=255u8).chain(0..=15).map(make).collect();
        let same = |got: f32, want: f32| got.to_bits() == want.to_bits() || got.is_nan() && want.is_nan();
        for start in 0..256 {
            let want: Vec<f32> = codes[start..start + 16].iter().map(|c| c.to_f32()).collect();
            if crate::simd::has_avx2_fma() {
                let mut got = [0.0f32; 8];
                // SAFETY: the CPU has AVX2; `codes` holds 16 readable elements from `start`.
                unsafe { _mm256_storeu_ps(got.as_mut_ptr(), T::load8(codes[start..].as_ptr())) };
                assert!(got.iter().zip(&want).all(|(&g, &w)| same(g, w)), "{got:?} {want:?}");
            }
            if crate::simd::has_avx512f() {
                let mut got = [0.0f32; 16];
                // SAFETY: the CPU has AVX-512F; 16 readable elements from `start`.
                unsafe { _mm512_storeu_ps(got.as_mut_ptr(), T::load16(codes[start..].as_ptr())) };
                assert!(got.iter().zip(&want).all(|(&g, &w)| same(g, w)), "{got:?} {want:?}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_loads_match_the_scalar_decode_for_every_code() {
        check_lanes(Fp8E4m3);
        check_lanes(Fp8E5m2);
    }

    #[test]
    fn encoding_rounds_ties_to_even_and_saturates() {
        // 1.0625 is halfway between 1.0 and 1.125 (e4m3): ties go to the even mantissa, 1.0.
        assert_eq!(Fp8E4m3::from_f32(1.0625).to_f32(), 1.0);
        assert_eq!(Fp8E4m3::from_f32(1.1875).to_f32(), 1.25);
        assert_eq!(Fp8E4m3::from_f32(1e6).to_f32(), 448.0);
        assert_eq!(Fp8E4m3::from_f32(f32::NEG_INFINITY).to_f32(), -448.0);
        assert_eq!(Fp8E5m2::from_f32(1e9).to_f32(), 57344.0);
        // Below half the smallest subnormal rounds to zero, keeping the sign.
        assert_eq!(Fp8E4m3::from_f32(-2f32.powi(-11)).0, 0x80);
        assert_eq!(Fp8E4m3::from_f32(3.0 * 2f32.powi(-10)).to_f32(), 2f32.powi(-8));
    }
}
