//! The W8A8 integer products in x86 intrinsics, one row block (up to three rows) against one
//! 16-feature tile of [`super::w8a8_pack`]'s layout, over the whole `k`:
//!
//! - [`vnni512`]: AVX512-VNNI, one `vpdpbusd` per 4 `k` × 16 features per row;
//! - [`vnni256`]: AVX-VNNI, the same in two 8-feature halves;
//! - [`madd16`]: AVX2, 4-feature × 4-`k` pieces of the tile widened to i16 and multiplied with
//!   `vpmaddwd` against the row's 4 activations (i16), each i32 lane holding one feature's
//!   products of 2 `k`.
//!
//! The VNNI loops keep several quads in flight per row (separate accumulators), so no
//! `vpdpbusd` waits on the one before.
//!
//! Also [`quantize_row`], the activations' quantization eight lanes at a time.

use std::arch::x86_64::*;

use super::{QUAD, ROW_BLOCK, TILE};

/// Bytes of one quad of a tile: 16 features × 4 `k`.
const QUAD_BYTES: usize = TILE * QUAD;

pub(super) fn has_avx512_vnni() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vnni"))
}

pub(super) fn has_avx_vnni() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("avxvnni"))
}

/// Four activation bytes (or i16 pairs: eight bytes) at `p` as one integer.
#[inline(always)]
unsafe fn read<T: Copy>(p: *const u8) -> T {
    p.cast::<T>().read_unaligned()
}

/// `acc[r] = Σ_k bytes[r, k] · tile[·, k]` for `rows` rows `kp` apart.
///
/// # Safety
/// The CPU has AVX512F and AVX512-VNNI; `bytes` holds `rows` rows of `kp`, `tile` `kp / 4` quads.
#[target_feature(enable = "avx512f,avx512vnni")]
pub(super) unsafe fn vnni512(
    bytes: &[u8],
    kp: usize,
    tile: &[u8],
    rows: usize,
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    match rows {
        1 => vnni512_rows::<1>(bytes, kp, tile, acc),
        2 => vnni512_rows::<2>(bytes, kp, tile, acc),
        _ => vnni512_rows::<3>(bytes, kp, tile, acc),
    }
}

/// Quads per step of the VNNI loops, each into its own accumulators.
const UNROLL: usize = 4;

#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni512_rows<const M: usize>(
    bytes: &[u8],
    kp: usize,
    tile: &[u8],
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    let (x, w) = (bytes.as_ptr(), tile.as_ptr());
    let mut a = [[_mm512_setzero_si512(); UNROLL]; M];
    let quads = kp / QUAD;
    let mut j = 0;
    while j < quads {
        for u in 0..UNROLL.min(quads - j) {
            let wv = _mm512_loadu_si512(w.add((j + u) * QUAD_BYTES).cast());
            for (r, a) in a.iter_mut().enumerate() {
                let xv = _mm512_set1_epi32(read::<i32>(x.add(r * kp + (j + u) * QUAD)));
                a[u] = _mm512_dpbusd_epi32(a[u], xv, wv);
            }
        }
        j += UNROLL;
    }
    for (r, a) in a.iter().enumerate() {
        let sum = _mm512_add_epi32(_mm512_add_epi32(a[0], a[1]), _mm512_add_epi32(a[2], a[3]));
        _mm512_storeu_si512(acc[r].as_mut_ptr().cast(), sum);
    }
}

/// [`vnni512`] with AVX-VNNI's 256-bit `vpdpbusd`.
///
/// # Safety
/// The CPU has AVX2 and AVX-VNNI; as [`vnni512`] otherwise.
#[target_feature(enable = "avx2,avxvnni")]
pub(super) unsafe fn vnni256(
    bytes: &[u8],
    kp: usize,
    tile: &[u8],
    rows: usize,
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    match rows {
        1 => vnni256_rows::<1>(bytes, kp, tile, acc),
        2 => vnni256_rows::<2>(bytes, kp, tile, acc),
        _ => vnni256_rows::<3>(bytes, kp, tile, acc),
    }
}

#[target_feature(enable = "avx2,avxvnni")]
unsafe fn vnni256_rows<const M: usize>(
    bytes: &[u8],
    kp: usize,
    tile: &[u8],
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    let (x, w) = (bytes.as_ptr(), tile.as_ptr());
    // Per row: [quad parity][half of the tile].
    let mut a = [[[_mm256_setzero_si256(); 2]; 2]; M];
    for j in 0..kp / QUAD {
        let p = w.add(j * QUAD_BYTES);
        let halves = [_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(QUAD_BYTES / 2).cast())];
        for (r, a) in a.iter_mut().enumerate() {
            let xv = _mm256_set1_epi32(read::<i32>(x.add(r * kp + j * QUAD)));
            for (h, half) in halves.iter().enumerate() {
                a[j % 2][h] = _mm256_dpbusd_avx_epi32(a[j % 2][h], xv, *half);
            }
        }
    }
    for (r, [even, odd]) in a.iter().enumerate() {
        for (h, (e, o)) in even.iter().zip(odd).enumerate() {
            _mm256_storeu_si256(acc[r].as_mut_ptr().add(8 * h).cast(), _mm256_add_epi32(*e, *o));
        }
    }
}

/// `acc[r] = Σ_k acts[r, k] · tile[·, k]` on i16 activations, `rows` rows `kp` apart.
///
/// # Safety
/// The CPU has AVX2; `acts` holds `rows` rows of `kp`, `tile` `kp / 4` quads.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn madd16(
    acts: &[i16],
    kp: usize,
    tile: &[u8],
    rows: usize,
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    match rows {
        1 => madd16_rows::<1>(acts, kp, tile, acc),
        2 => madd16_rows::<2>(acts, kp, tile, acc),
        _ => madd16_rows::<3>(acts, kp, tile, acc),
    }
}

/// Per quad: the row's four activations broadcast; each 16-byte quarter of the tile's quad
/// (features `4c..4c + 4`, 4 `k` each) widened and multiplied, lane `l` of accumulator `c`
/// gathering feature `4c + l / 2`'s products of `k` pair `l % 2`. Three rows: 12 accumulators,
/// one weight vector and three activation vectors fill the 16 registers.
#[target_feature(enable = "avx2")]
unsafe fn madd16_rows<const M: usize>(
    acts: &[i16],
    kp: usize,
    tile: &[u8],
    acc: &mut [[i32; TILE]; ROW_BLOCK],
) {
    let (x, w) = (acts.as_ptr().cast::<u8>(), tile.as_ptr());
    let mut a = [[_mm256_setzero_si256(); 4]; M];
    for j in 0..kp / QUAD {
        let mut xs = [_mm256_setzero_si256(); M];
        for (r, xv) in xs.iter_mut().enumerate() {
            *xv = _mm256_set1_epi64x(read::<i64>(x.add(2 * (r * kp + j * QUAD))));
        }
        for c in 0..4 {
            let wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(w.add(j * QUAD_BYTES + 16 * c).cast()));
            for (a, xv) in a.iter_mut().zip(&xs) {
                a[c] = _mm256_add_epi32(a[c], _mm256_madd_epi16(wv, *xv));
            }
        }
    }
    for (r, a) in a.iter().enumerate() {
        for (c, v) in a.iter().enumerate() {
            let mut lanes = [0i32; 8];
            _mm256_storeu_si256(lanes.as_mut_ptr().cast(), *v);
            for (l, lane) in lanes.iter().enumerate() {
                acc[r][4 * c + l / 2] += lane;
            }
        }
    }
}

/// [`super::quantize_row`] for `scale > 0`: the division and the rounding (the default mode,
/// to nearest even) in eight lanes; values clamped before the conversion so none overflows it.
///
/// # Safety
/// The CPU has AVX2; `q` is as long as `row`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_row(row: &[f32], scale: f32, zp: i32, q: &mut [i32]) {
    let (s, zero_point) = (_mm256_set1_ps(scale), _mm256_set1_epi32(zp));
    let (low, high) = (_mm256_set1_ps(-1024.0), _mm256_set1_ps(1024.0));
    let (min, max) = (_mm256_set1_epi32(-128), _mm256_set1_epi32(127));
    let whole = row.len() / 8 * 8;
    for i in (0..whole).step_by(8) {
        let v =
            _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(row.as_ptr().add(i)), s), low), high);
        let r = _mm256_add_epi32(_mm256_cvtps_epi32(v), zero_point);
        _mm256_storeu_si256(q.as_mut_ptr().add(i).cast(), _mm256_min_epi32(_mm256_max_epi32(r, min), max));
    }
    for (q, v) in q[whole..].iter_mut().zip(&row[whole..]) {
        *q = (((v / scale).round_ties_even().clamp(-1024.0, 1024.0)) as i32 + zp).clamp(-128, 127);
    }
}
