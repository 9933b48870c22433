//! One random draw per row straight from the logits: token `i` with probability
//! `exp(logit_i) / Σ exp`, by the inverse of the row's cumulative distribution at a uniform number
//! the caller draws (so a seeded request's generator stays in Python, one number per step).
//!
//! torch's path (softmax, then a two-level search over block sums in a dozen small ops) took
//! ~0.3 ms per row on the 2-core development machine, ~7% of a SmolLM2 decode step; here the
//! row is read twice (its maximum, then each block's sum of `exp(logit - max)`), a float64
//! cumulative sum walks the blocks, and only the chosen block's exponentials are taken again.
//! The softmax's division is never done: the uniform number is scaled by the row's total instead.
//! A logit of `-inf` (a token a filter removed) or NaN has no mass; a row with no mass at all is
//! refused.

use crate::error::{check_len, KernelError};
use crate::openmp::for_each_share;
use crate::simd::exp;

/// Tokens per block of the search: one block's exponentials are taken twice.
const BLOCK: usize = 256;
/// Lanes of the maximum and of a block's sum (a single float would be a chain of dependent adds).
const LANES: usize = 16;

/// Writes `out[r]`, a token drawn from row `r` of `logits` (`[rows, vocab]`) at the uniform
/// number `uniforms[r]` in `[0, 1)`, rows split over up to `threads`.
///
/// # Errors
/// Buffers that do not fit, a uniform number outside `[0, 1)`, or a row whose every logit is
/// `-inf` or NaN (nothing to draw; `out` is then partly written).
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    uniforms: &[f64],
    out: &mut [i64],
    threads: usize,
) -> Result<(), KernelError> {
    let rows = out.len();
    check_len("uniforms", uniforms.len(), rows)?;
    check_len("logits", logits.len(), rows * vocab)?;
    if let Some(&u) = uniforms.iter().find(|u| !(0.0..1.0).contains(*u)) {
        let limit = "in [0, 1)".to_string();
        return Err(KernelError::Param { name: "uniforms", limit, value: u.to_string() });
    }
    for_each_share(out, 1, 1, threads, |range, picks| {
        for (row, pick) in range.zip(picks.iter_mut()) {
            *pick = draw(&logits[row * vocab..(row + 1) * vocab], uniforms[row]).map_or(-1, |t| t as i64);
        }
    });
    if let Some(row) = out.iter().position(|&pick| pick < 0) {
        let limit = "at least one finite logit".to_string();
        return Err(KernelError::Param { name: "logits", limit, value: format!("row {row} has none") });
    }
    Ok(())
}

/// [`draw_in`] compiled for the widest vectors the CPU has: the two passes over the row are
/// its time, and `exp` vectorizes.
fn draw(row: &[f32], u: f64) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx512f,avx2,fma")]
        unsafe fn widest(row: &[f32], u: f64) -> Option<usize> {
            draw_in(row, u)
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide(row: &[f32], u: f64) -> Option<usize> {
            draw_in(row, u)
        }
        if crate::simd::has_avx512f() {
            // SAFETY: the CPU has every feature `widest` was compiled for.
            return unsafe { widest(row, u) };
        }
        if crate::simd::has_avx2_fma() {
            // SAFETY: the CPU has every feature `wide` was compiled for.
            return unsafe { wide(row, u) };
        }
    }
    draw_in(row, u)
}

/// The token of `row` whose cumulative mass first passes `u` × the row's total; `None` when the
/// row has no mass.
#[inline(always)]
fn draw_in(row: &[f32], u: f64) -> Option<usize> {
    let max = row_max(row);
    if !max.is_finite() {
        return None;
    }
    // Plain loops: an iterator adapter's `fold` is a function of its own, compiled without the
    // caller's vector features (it ran the exponentials four lanes wide).
    let mut masses = Vec::with_capacity(row.len().div_ceil(BLOCK));
    let mut total = 0.0;
    for block in row.chunks(BLOCK) {
        let mass = block_mass(block, max);
        masses.push(mass);
        total += mass;
    }
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    // The first block whose cumulative mass passes `target`, and the mass before it; rounding
    // can leave `target` past the last sum, and then the last block with mass takes it.
    let (mut at, mut pick) = (0.0, None);
    for (b, &mass) in masses.iter().enumerate() {
        if mass > 0.0 {
            pick = Some((b, at));
            if at + mass > target {
                break;
            }
        }
        at += mass;
    }
    let (b, before) = pick?;
    let block = &row[b * BLOCK..row.len().min((b + 1) * BLOCK)];
    let (mut sum, mut last) = (before, None);
    for (i, &logit) in block.iter().enumerate() {
        let p = weight(logit, max);
        if p > 0.0 {
            last = Some(i);
            sum += f64::from(p);
            if sum > target {
                break;
            }
        }
    }
    last.map(|i| b * BLOCK + i)
}

/// `exp(logit - max)`, and exactly 0 for `-inf` (the fast `exp` would give ~1e-38) and NaN.
#[inline(always)]
fn weight(logit: f32, max: f32) -> f32 {
    // Taken whatever the logit, then selected, so the loop has no branch to vectorize around.
    let e = exp(logit - max);
    if logit > f32::NEG_INFINITY {
        e
    } else {
        0.0
    }
}

/// The largest logit, NaN left out (`-inf` where there is none).
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in lanes.iter_mut().zip(chunk) {
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &x in tail.iter().chain(&lanes) {
        max = if x > max { x } else { max };
    }
    max
}

/// Σ `exp(logit - max)` over a block, in float32 lanes, as float64.
#[inline(always)]
fn block_mass(block: &[f32], max: f32) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = block.chunks_exact(LANES);
    let mut sum = 0.0f64;
    for &x in chunks.remainder() {
        sum += f64::from(weight(x, max));
    }
    for chunk in chunks {
        for (s, &x) in lanes.iter_mut().zip(chunk) {
            *s += weight(x, max);
        }
    }
    for s in lanes {
        sum += f64::from(s);
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::values;

    /// The f64 distribution of a row: each token's cumulative interval.
    fn intervals(row: &[f32]) -> Vec<(f64, f64)> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let p: Vec<f64> = row.iter().map(|&l| (l as f64 - max).exp()).collect();
        let total: f64 = p.iter().sum();
        let mut at = 0.0;
        p.iter()
            .map(|&p| {
                let start = at;
                at += p / total;
                (start, at)
            })
            .collect()
    }

    #[test]
    fn a_uniform_inside_a_tokens_interval_draws_that_token() {
        // Three blocks and a short one; logits spread so mass sits in every block.
        let vocab = 3 * BLOCK + 77;
        let row: Vec<f32> = values(vocab, 5).iter().map(|v| 4.0 * v).collect();
        let spans = intervals(&row);
        for token in [0, 1, 255, 256, 300, 767, 768, vocab - 1] {
            let (start, end) = spans[token];
            if end - start < 1e-9 {
                continue;
            }
            let mut out = [0i64];
            sample_rows(&row, vocab, &[(start + end) / 2.0], &mut out, 1).unwrap();
            assert_eq!(out[0], token as i64);
        }
    }

    #[test]
    fn removed_tokens_are_never_drawn_and_rows_are_independent() {
        let vocab = 600;
        let mut logits: Vec<f32> = values(2 * vocab, 7);
        for (i, l) in logits.iter_mut().enumerate() {
            if i % 3 != 0 {
                *l = f32::NEG_INFINITY; // two thirds removed, in both rows
            }
        }
        logits[vocab + 599] = 50.0; // the second row is all but certain
        for k in 0..200 {
            let u = k as f64 / 200.0;
            let mut out = [0i64; 2];
            sample_rows(&logits, vocab, &[u, u], &mut out, 2).unwrap();
            assert_eq!(out[0] % 3, 0, "u {u}: drew a removed token {}", out[0]);
            assert!(out[1] == 599 || k == 0, "u {u}: {}", out[1]);
        }
        let mut out = [0i64];
        sample_rows(&logits[..vocab], vocab, &[0.999_999_999], &mut out, 1).unwrap();
        assert_eq!(out[0], 597, "the last token with mass takes the top of the range");
    }

    #[test]
    fn draws_follow_the_softmax() {
        // 20,000 evenly spaced uniforms: each token's share is its probability to ~1/20,000.
        let vocab = 700;
        let row: Vec<f32> = values(vocab, 9).iter().map(|v| 3.0 * v).collect();
        let spans = intervals(&row);
        let n = 20_000;
        let mut counts = vec![0usize; vocab];
        for k in 0..n {
            let mut out = [0i64];
            sample_rows(&row, vocab, &[(k as f64 + 0.5) / n as f64], &mut out, 1).unwrap();
            counts[out[0] as usize] += 1;
        }
        for (t, &(start, end)) in spans.iter().enumerate() {
            let want = (end - start) * n as f64;
            assert!(
                (counts[t] as f64 - want).abs() <= 1.0 + 1e-3 * want,
                "token {t}: {} vs {want}",
                counts[t]
            );
        }
    }

    #[test]
    fn refuses_rows_without_mass_and_uniforms_out_of_range() {
        let mut out = [0i64; 2];
        let logits = [0.0, 1.0, f32::NEG_INFINITY, f32::NAN];
        let err = sample_rows(&logits, 2, &[0.5, 0.5], &mut out, 1).unwrap_err();
        assert!(err.to_string().contains("row 1 has none"), "{err}");
        let err = sample_rows(&logits[..2], 2, &[1.0], &mut out[..1], 1).unwrap_err();
        assert!(err.to_string().contains("`uniforms` must be in [0, 1)"), "{err}");
        let err = sample_rows(&logits, 2, &[0.5], &mut out, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "uniforms", expected: 2, actual: 1 });
    }
}
