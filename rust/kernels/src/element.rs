use std::any::TypeId;

mod fp8;

pub use fp8::{Fp8E4m3, Fp8E5m2};

/// A tensor element the kernels read and write; arithmetic happens in `f32`.
pub trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(value: f32) -> Self;
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        value
    }
}

/// bfloat16 as its bit pattern (torch's `torch.bfloat16` memory layout).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Element for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.0) << 16)
    }
    /// Round to nearest even, as torch (and the hardware) convert; NaN stays a quiet NaN.
    #[inline(always)]
    fn from_f32(value: f32) -> Self {
        let bits = value.to_bits();
        if value.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        let rounding = 0x7fff + ((bits >> 16) & 1);
        Bf16((bits.wrapping_add(rounding) >> 16) as u16)
    }
}

/// `x` as f32 when `T` is f32: kernels that have an f32-only path (or can read f32 `x` in place)
/// take it without a copy.
pub(crate) fn as_f32<T: Element>(x: &[T]) -> Option<&[f32]> {
    // SAFETY: `T` is `f32` itself, so the slice is reinterpreted as its own type.
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| unsafe { &*(x as *const [T] as *const [f32]) })
}

/// [`as_f32`] for a mutable slice.
pub(crate) fn as_f32_mut<T: Element>(x: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: as `as_f32`.
    (TypeId::of::<T>() == TypeId::of::<f32>()).then(|| unsafe { &mut *(x as *mut [T] as *mut [f32]) })
}

/// Rounds `value` to `T` and back: what torch's result holds after an op in `T`.
#[inline(always)]
pub(crate) fn round<T: Element>(value: f32) -> f32 {
    T::from_f32(value).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even() {
        assert_eq!(Bf16::from_f32(1.0).0, 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).0, 0x3f80);
        assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).0, 0x3f82);
        assert!(Bf16::from_f32(f32::NAN).to_f32().is_nan());
        assert_eq!(Bf16::from_f32(f32::INFINITY).to_f32(), f32::INFINITY);
        assert_eq!(Bf16::from_f32(-2.5).to_f32(), -2.5);
    }
}
