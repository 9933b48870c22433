//! Writing a step's keys and values into the paged KV cache.
//!
//! Each token's keys (all its KV heads, side by side) go to one slot of the cache, the flat index
//! `block_id * block_size + offset` the scheduler's slot mapping holds. The inputs may be rows of
//! a wider tensor (the value part of a fused qkv output), hence the row strides. A decode step
//! writes a few hundred bytes per layer, so this runs on the calling thread: the torch path it
//! replaces spent its time in two `index_copy_` dispatches, not in copying.
//!
//! An fp8 cache ([`write_kv_quantized`]) stores `x / scale` rounded to the format (saturating),
//! with one scale for all keys and one for all values (vLLM's per-tensor `k_scale`, `v_scale`);
//! readers multiply back.

use crate::element::Element;
use crate::error::{check_len, KernelError};

/// The per-tensor scales of a quantized cache: stored value = `x / scale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    pub key: f32,
    pub value: f32,
}

/// The step's rows and the cache's slots.
#[derive(Clone, Copy, Debug)]
pub struct CacheWriteShape {
    /// Tokens written.
    pub tokens: usize,
    /// Elements per token: KV heads × head size.
    pub width: usize,
    /// Elements from one token's keys to the next token's.
    pub key_stride: usize,
    /// Elements from one token's values to the next token's.
    pub value_stride: usize,
}

/// Copies token `i`'s keys and values (`width` elements at `i * key_stride`, `i * value_stride`)
/// to slot `slot_mapping[i]` of `key_cache` and `value_cache` (`[slots, width]` each). Every slot
/// is checked before anything is written.
pub fn write_kv<T: Copy>(
    key: &[T],
    value: &[T],
    slot_mapping: &[i64],
    key_cache: &mut [T],
    value_cache: &mut [T],
    shape: CacheWriteShape,
) -> Result<(), KernelError> {
    if !check_write(key.len(), value.len(), slot_mapping, key_cache.len(), value_cache.len(), shape)? {
        return Ok(());
    }
    let CacheWriteShape { width, key_stride, value_stride, .. } = shape;
    for (i, &slot) in slot_mapping.iter().enumerate() {
        let dst = slot as usize * width..(slot as usize + 1) * width;
        key_cache[dst.clone()].copy_from_slice(&key[i * key_stride..][..width]);
        value_cache[dst].copy_from_slice(&value[i * value_stride..][..width]);
    }
    Ok(())
}

/// [`write_kv`] into a cache of another element type (fp8): each element becomes
/// `C::from_f32(x / scale)`, keys with `scales.key`, values with `scales.value`.
pub fn write_kv_quantized<T: Element, C: Element>(
    key: &[T],
    value: &[T],
    slot_mapping: &[i64],
    key_cache: &mut [C],
    value_cache: &mut [C],
    shape: CacheWriteShape,
    scales: KvScales,
) -> Result<(), KernelError> {
    for (name, scale) in [("k_scale", scales.key), ("v_scale", scales.value)] {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(KernelError::Value {
                name,
                limit: "a finite number > 0".into(),
                value: scale as i64,
            });
        }
    }
    if !check_write(key.len(), value.len(), slot_mapping, key_cache.len(), value_cache.len(), shape)? {
        return Ok(());
    }
    let CacheWriteShape { width, key_stride, value_stride, .. } = shape;
    let put = |dst: &mut [C], src: &[T], scale: f32| {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = C::from_f32(s.to_f32() / scale);
        }
    };
    for (i, &slot) in slot_mapping.iter().enumerate() {
        let dst = slot as usize * width..(slot as usize + 1) * width;
        put(&mut key_cache[dst.clone()], &key[i * key_stride..][..width], scales.key);
        put(&mut value_cache[dst], &value[i * value_stride..][..width], scales.value);
    }
    Ok(())
}

/// Checks a write's buffers and slots (buffer lengths in elements); returns whether there is
/// anything to write.
fn check_write(
    key_len: usize,
    value_len: usize,
    slot_mapping: &[i64],
    key_cache_len: usize,
    value_cache_len: usize,
    shape: CacheWriteShape,
) -> Result<bool, KernelError> {
    let CacheWriteShape { tokens, width, key_stride, value_stride } = shape;
    check_len("slot_mapping", slot_mapping.len(), tokens)?;
    if tokens == 0 {
        return Ok(false);
    }
    check_rows("key", key_len, tokens, width, key_stride)?;
    check_rows("value", value_len, tokens, width, value_stride)?;
    if width == 0 || !key_cache_len.is_multiple_of(width) {
        return Err(KernelError::Value {
            name: "width",
            limit: format!("a positive divisor of the cache's {key_cache_len} elements"),
            value: width as i64,
        });
    }
    check_len("value_cache", value_cache_len, key_cache_len)?;
    let slots = key_cache_len / width;
    if let Some(&bad) = slot_mapping.iter().find(|&&s| s < 0 || s as usize >= slots) {
        return Err(KernelError::Value {
            name: "slot_mapping",
            limit: format!("between 0 and {}", slots as i64 - 1),
            value: bad,
        });
    }
    Ok(true)
}

/// `rows` rows of `width` elements, `stride` apart, fit in `len` (the last row may end early).
fn check_rows(
    name: &'static str,
    len: usize,
    rows: usize,
    width: usize,
    stride: usize,
) -> Result<(), KernelError> {
    if stride < width {
        return Err(KernelError::Value {
            name,
            limit: format!("rows at least {width} elements apart"),
            value: stride as i64,
        });
    }
    check_len(name, len, (rows - 1) * stride + width)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: CacheWriteShape = CacheWriteShape { tokens: 2, width: 3, key_stride: 5, value_stride: 3 };

    #[test]
    fn writes_each_token_to_its_slot_from_strided_rows() {
        let key: Vec<f32> = (0..8).map(|v| v as f32).collect(); // rows 0..3 and 5..8
        let value: Vec<f32> = (10..16).map(|v| v as f32).collect();
        let (mut kc, mut vc) = (vec![-1.0f32; 12], vec![-1.0f32; 12]);
        write_kv(&key, &value, &[3, 1], &mut kc, &mut vc, SHAPE).unwrap();
        assert_eq!(kc, [-1., -1., -1., 5., 6., 7., -1., -1., -1., 0., 1., 2.]);
        assert_eq!(vc, [-1., -1., -1., 13., 14., 15., -1., -1., -1., 10., 11., 12.]);
    }

    #[test]
    fn a_slot_outside_the_cache_is_refused_before_any_write() {
        let (key, value) = (vec![1.0f32; 8], vec![1.0f32; 6]);
        let (mut kc, mut vc) = (vec![0.0f32; 12], vec![0.0f32; 12]);
        for bad in [4, -1] {
            let err = write_kv(&key, &value, &[0, bad], &mut kc, &mut vc, SHAPE).unwrap_err();
            assert_eq!(
                err,
                KernelError::Value { name: "slot_mapping", limit: "between 0 and 3".into(), value: bad }
            );
        }
        assert!(kc.iter().chain(&vc).all(|&v| v == 0.0));
    }

    #[test]
    fn quantized_write_stores_each_element_over_its_scale() {
        use crate::element::Fp8E4m3;
        let key: Vec<f32> = (0..8).map(|v| v as f32).collect();
        let value: Vec<f32> = (10..16).map(|v| v as f32 * 100.0).collect();
        let (mut kc, mut vc) = (vec![Fp8E4m3(0); 12], vec![Fp8E4m3(0); 12]);
        let scales = KvScales { key: 0.5, value: 4.0 };
        write_kv_quantized(&key, &value, &[3, 1], &mut kc, &mut vc, SHAPE, scales).unwrap();
        let k: Vec<f32> = kc.iter().map(|c| c.to_f32()).collect();
        let v: Vec<f32> = vc.iter().map(|c| c.to_f32()).collect();
        assert_eq!(k, [0., 0., 0., 10., 12., 14., 0., 0., 0., 0., 2., 4.]);
        // 1300 / 4 = 325 lies between e4m3's 320 and 352; 1500 / 4 = 375 rounds to 384; 1000 / 4 = 250 to 256.
        assert_eq!(&v[3..6], [320., 352., 384.]);
        assert_eq!(&v[9..12], [256., 288., 288.]);
        let err = write_kv_quantized(
            &key,
            &value,
            &[3, 1],
            &mut kc,
            &mut vc,
            SHAPE,
            KvScales { key: 0.0, value: 1.0 },
        );
        assert!(matches!(err, Err(KernelError::Value { name: "k_scale", .. })));
    }

    #[test]
    fn mismatched_buffers_are_refused() {
        let (key, value) = (vec![1.0f32; 7], vec![1.0f32; 6]);
        let (mut kc, mut vc) = (vec![0.0f32; 12], vec![0.0f32; 12]);
        let err = write_kv(&key, &value, &[0, 1], &mut kc, &mut vc, SHAPE).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "key", expected: 8, actual: 7 });
        let mut short = vec![0.0f32; 9];
        let err = write_kv(&[1.0f32; 8], &value, &[0, 1], &mut kc, &mut short, SHAPE).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "value_cache", expected: 12, actual: 9 });
        assert!(
            write_kv::<f32>(&[], &[], &[], &mut kc, &mut vc, CacheWriteShape { tokens: 0, ..SHAPE }).is_ok()
        );
    }
}
