//! The W8A8 integer products in x86 intrinsics, one row block (up to three rows) against one
//! 16-feature tile of [`super::w8a8_pack`]'s layout, over the whole `k`:
//!
//! - [`vnni512`]: AVX512-VNNI, one `vpdpbusd` per 4 `k` × 16 features per row, and
//!   [`vnni512_pair`], the same for two tiles and up to six rows at once (prompt-sized calls);
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

use super::{PAIR, PAIR_ROWS, QUAD, ROW_BLOCK, TILE};

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

/// [`vnni512`] for two tiles side by side (`TILE · kp` bytes apart in `pair`) and up to
/// [`PAIR_ROWS`] rows: `acc[r][TILE · t + i]` is row `r`'s product with tile `t`'s feature `i`.
/// Each quad's two weight vectors serve every row and each row's broadcast both tiles, so a
/// `vpdpbusd` costs 1/3 of a load where the one-tile kernel's cost 4/3: in L1, one thread, a
/// hand-written loop of this shape issued 4.4 G `vpdpbusd`/s where [`vnni512`] issued 1.6.
///
/// # Safety
/// The CPU has AVX512F and AVX512-VNNI; `bytes` holds `rows` rows of `kp`, `pair` two tiles of
/// `kp / 4` quads.
#[target_feature(enable = "avx512f,avx512vnni")]
pub(super) unsafe fn vnni512_pair(
    bytes: &[u8],
    kp: usize,
    pair: &[u8],
    rows: usize,
    acc: &mut [[i32; PAIR]; PAIR_ROWS],
) {
    debug_assert!(bytes.len() >= rows * kp && pair.len() >= 2 * TILE * kp);
    match rows {
        1 => vnni512_pair_rows::<1>(bytes, kp, pair, acc),
        2 => vnni512_pair_rows::<2>(bytes, kp, pair, acc),
        3 => vnni512_pair_rows::<3>(bytes, kp, pair, acc),
        4 => vnni512_pair_rows::<4>(bytes, kp, pair, acc),
        5 => vnni512_pair_rows::<5>(bytes, kp, pair, acc),
        _ => vnni512_pair_rows::<6>(bytes, kp, pair, acc),
    }
}

#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni512_pair_rows<const M: usize>(
    bytes: &[u8],
    kp: usize,
    pair: &[u8],
    acc: &mut [[i32; PAIR]; PAIR_ROWS],
) {
    let (x, w0) = (bytes.as_ptr(), pair.as_ptr());
    let w1 = w0.add(TILE * kp);
    // Six rows keep twelve sums in flight, more than `vpdpbusd`'s latency times its rate.
    let mut a = [[_mm512_setzero_si512(); 2]; M];
    for j in 0..kp / QUAD {
        let v0 = _mm512_loadu_si512(w0.add(j * QUAD_BYTES).cast());
        let v1 = _mm512_loadu_si512(w1.add(j * QUAD_BYTES).cast());
        for (r, a) in a.iter_mut().enumerate() {
            let xv = _mm512_set1_epi32(read::<i32>(x.add(r * kp + j * QUAD)));
            a[0] = _mm512_dpbusd_epi32(a[0], xv, v0);
            a[1] = _mm512_dpbusd_epi32(a[1], xv, v1);
        }
    }
    for (r, a) in a.iter().enumerate() {
        _mm512_storeu_si512(acc[r].as_mut_ptr().cast(), a[0]);
        _mm512_storeu_si512(acc[r].as_mut_ptr().add(TILE).cast(), a[1]);
    }
}

/// One tile's features as outputs: `Σ_k qw` per feature, and the weight scale and bias of its
/// real features (`scale.len()`, at most [`TILE`]; the last tile's may be fewer).
pub(super) struct TileOut<'a> {
    pub sums: [i32; TILE],
    pub scale: &'a [f32],
    pub bias: Option<&'a [f32]>,
}

/// Where [`scale_pair_rows`] writes: `rows` rows `stride` floats apart from `out` (the first
/// row's first feature of the pair), row `r`'s activation scale `s_x[r]`, and the `offset`
/// each weight sum is multiplied by and taken off.
pub(super) struct PairOut<'a> {
    pub tiles: [TileOut<'a>; 2],
    pub offset: i32,
    pub s_x: &'a [f32],
    pub out: *mut f32,
    pub stride: usize,
}

/// `out[r][i] = s_x[r] · scale[i] · (acc[r][i] - offset · sums[i]) + bias[i]` for the pair's
/// real features: the scalar loop's operations in its order (the same bits), each tile's
/// vectors loaded once for all the rows.
///
/// # Safety
/// The CPU has AVX512F; `o.out` has room for `o.s_x.len()` rows of the pair's features.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn scale_pair_rows(acc: &[[i32; PAIR]; PAIR_ROWS], o: &PairOut<'_>) {
    for (t, tile) in o.tiles.iter().enumerate() {
        let len = tile.scale.len();
        if len == 0 {
            continue;
        }
        let mask: __mmask16 = if len >= TILE { !0 } else { (1u16 << len) - 1 };
        let taken =
            _mm512_mullo_epi32(_mm512_set1_epi32(o.offset), _mm512_loadu_si512(tile.sums.as_ptr().cast()));
        let scale = _mm512_maskz_loadu_ps(mask, tile.scale.as_ptr());
        let bias = tile.bias.map_or(_mm512_setzero_ps(), |b| _mm512_maskz_loadu_ps(mask, b.as_ptr()));
        for (r, (acc, &s_x)) in acc.iter().zip(o.s_x).enumerate() {
            let dot = _mm512_sub_epi32(_mm512_loadu_si512(acc.as_ptr().add(TILE * t).cast()), taken);
            let scaled = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(s_x), scale), _mm512_cvtepi32_ps(dot));
            _mm512_mask_storeu_ps(o.out.add(r * o.stride + TILE * t), mask, _mm512_add_ps(scaled, bias));
        }
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

/// The largest `|v|` of `row`, NaN ignored: `vmaxps` returns its second operand when the
/// first is NaN, and the running maximum (from 0) is never NaN.
///
/// # Safety
/// The CPU has AVX512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn max_abs(row: &[f32]) -> f32 {
    let mut m = _mm512_setzero_ps();
    let whole = row.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(row.as_ptr().add(i))), m);
    }
    let tail = row[whole..].iter().fold(0.0f32, |m, v| m.max(v.abs()));
    _mm512_reduce_max_ps(m).max(tail)
}

/// [`quantize_row`] for `scale > 0` straight to the bytes `q + 128`, sixteen lanes at a time
/// with the same operations (so the same values).
///
/// # Safety
/// The CPU has AVX512F; `out` is as long as `row`.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn quantize_row_u8(row: &[f32], scale: f32, zp: i32, out: &mut [u8]) {
    let (s, zero_point) = (_mm512_set1_ps(scale), _mm512_set1_epi32(zp));
    let (low, high) = (_mm512_set1_ps(-1024.0), _mm512_set1_ps(1024.0));
    let (min, max, half) = (_mm512_set1_epi32(-128), _mm512_set1_epi32(127), _mm512_set1_epi32(128));
    let whole = row.len() / 16 * 16;
    for i in (0..whole).step_by(16) {
        let v =
            _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(row.as_ptr().add(i)), s), low), high);
        let q =
            _mm512_min_epi32(_mm512_max_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(v), zero_point), min), max);
        _mm_storeu_si128(out.as_mut_ptr().add(i).cast(), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, half)));
    }
    for (b, v) in out[whole..].iter_mut().zip(&row[whole..]) {
        let q = (((v / scale).round_ties_even().clamp(-1024.0, 1024.0)) as i32 + zp).clamp(-128, 127);
        *b = (q + 128) as u8;
    }
}
