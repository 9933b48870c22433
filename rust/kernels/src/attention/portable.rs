//! The portable decode kernel: plain loops the compiler vectorizes (compiled for AVX-512, for
//! AVX2/FMA and for neither, picked at run time), for head sizes and CPUs the intrinsics kernels
//! do not take, and as their reference in the tests.

use super::{Softmax, Unit, TILE};
use crate::element::Element;
use crate::simd::{axpy, load, multiversion, prefetch};

multiversion!(pub(super) fn attend_portable<T, C>(unit: &Unit<'_, C>, soft_cap: Option<f32>, out: &mut [T]) -> Vec<f32> => attend_portable_body);

/// Value rows requested ahead of the one being summed.
const PREFETCH_AHEAD: usize = 8;

/// Two passes over one (request, KV head) context: scores for every group head, then the
/// softmax-weighted sum of values. Scores are kept whole (`group x context` floats) rather than
/// rescaled online, which keeps the inner loops plain.
///
/// Keys are taken `TILE` tokens at a time and transposed into `[head_dim, TILE]` f32, so a score
/// tile is `head_dim` multiply-adds with the tokens in the vector lanes; a dot product per token
/// would end in a horizontal sum costing more than its multiply-adds at `head_dim = 64`. This is
/// the kernel for head sizes and CPUs the AVX2 one (`avx2`) does not take.
#[inline(always)]
fn attend_portable_body<T: Element, C: Element>(
    unit: &Unit<'_, C>,
    soft_cap: Option<f32>,
    out: &mut [T],
) -> Vec<f32> {
    let head_len = unit.group * unit.dim;
    let mut log_masses = Vec::with_capacity(unit.kv_heads * unit.group);
    for (kv_head, out) in out.chunks_exact_mut(head_len).enumerate() {
        log_masses.extend(attend_portable_head(unit, kv_head, soft_cap, out));
    }
    log_masses
}

/// The portable kernel for the query heads sharing KV head `kv_head`.
#[inline(always)]
fn attend_portable_head<T: Element, C: Element>(
    unit: &Unit<'_, C>,
    kv_head: usize,
    soft_cap: Option<f32>,
    out: &mut [T],
) -> Vec<f32> {
    let (dim, group, n) = (unit.dim, unit.group, unit.slots.len());
    let query = &unit.query[kv_head * group * dim..][..group * dim];
    // Scores padded to whole tiles; the padding is never read back.
    let padded = n.div_ceil(TILE) * TILE;
    let mut scores = vec![0.0f32; group * padded];
    let mut keys_t = vec![0.0f32; dim * TILE];
    let key_row = |t: usize| &unit.key_cache[unit.slots[t] + kv_head * dim..][..dim];
    let value_row = |t: usize| &unit.value_cache[unit.slots[t] + kv_head * dim..][..dim];
    for t in 0..TILE.min(n) {
        prefetch(key_row(t));
    }
    for tile_start in (0..n).step_by(TILE) {
        let len = TILE.min(n - tile_start);
        for t in (tile_start + TILE..n).take(TILE) {
            prefetch(key_row(t));
        }
        for j in 0..len {
            let key = key_row(tile_start + j);
            for (d, k) in key.iter().enumerate() {
                keys_t[d * TILE + j] = k.to_f32();
            }
        }
        for g in 0..group {
            let tile = score_tile(&query[g * dim..][..dim], &keys_t);
            scores[g * padded + tile_start..][..TILE].copy_from_slice(&tile);
        }
    }
    let softmax = Softmax::of(&mut scores, padded, n, group, soft_cap, unit.value_scale);
    let totals = &softmax.totals;
    let mut acc = vec![0.0f32; group * dim];
    let mut value = vec![0.0f32; dim];
    for t in 0..PREFETCH_AHEAD.min(n) {
        prefetch(value_row(t));
    }
    for i in 0..n {
        if i + PREFETCH_AHEAD < n {
            prefetch(value_row(i + PREFETCH_AHEAD));
        }
        load(value_row(i), &mut value);
        for g in 0..group {
            axpy(&mut acc[g * dim..][..dim], scores[g * padded + i], &value);
        }
    }
    for g in 0..group {
        let inv = 1.0 / totals[g];
        for (o, a) in out[g * dim..][..dim].iter_mut().zip(&acc[g * dim..][..dim]) {
            *o = T::from_f32(a * inv);
        }
    }
    softmax.log_masses
}

/// `q . k_j` for the `TILE` keys of `keys_t` (`[head_dim, TILE]`). Four partial tiles, so four
/// multiply-add chains are in flight instead of one waiting on the previous add's latency.
#[inline(always)]
fn score_tile(query: &[f32], keys_t: &[f32]) -> [f32; TILE] {
    let (mut a0, mut a1, mut a2, mut a3) = ([0.0f32; TILE], [0.0f32; TILE], [0.0f32; TILE], [0.0f32; TILE]);
    let body = query.len() / 4 * 4;
    for (q, c) in query[..body].chunks_exact(4).zip(keys_t.chunks_exact(4 * TILE)) {
        let (c0, rest) = c.split_at(TILE);
        let (c1, rest) = rest.split_at(TILE);
        let (c2, c3) = rest.split_at(TILE);
        for j in 0..TILE {
            a0[j] += q[0] * c0[j];
            a1[j] += q[1] * c1[j];
            a2[j] += q[2] * c2[j];
            a3[j] += q[3] * c3[j];
        }
    }
    for (q, c) in query[body..].iter().zip(keys_t[body * TILE..].chunks_exact(TILE)) {
        for j in 0..TILE {
            a0[j] += q * c[j];
        }
    }
    for j in 0..TILE {
        a0[j] = (a0[j] + a1[j]) + (a2[j] + a3[j]);
    }
    a0
}
