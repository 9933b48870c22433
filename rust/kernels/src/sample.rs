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

use crate::element::Element;
use crate::error::{check_len, KernelError};
use crate::openmp::for_each_share;
use crate::simd::{exp, multiversion};

/// Tokens per block of the search: one block's exponentials are taken twice.
const BLOCK: usize = 256;
/// Lanes of the maximum and of a block's sum (a single float would be a chain of dependent adds).
const LANES: usize = 16;
/// Blocks per thread, at least, when one row's passes are split over the team (Qwen2's 151,936
/// logits are 594 blocks).
const MIN_BLOCKS_PER_THREAD: usize = 64;

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
    if rows < threads && vocab >= 2 * MIN_BLOCKS_PER_THREAD * BLOCK {
        // Fewer rows than threads (batch-1 decode): each row's two passes are split instead,
        // where the other core would wait through the whole vocabulary.
        for (row, pick) in out.iter_mut().enumerate() {
            *pick = draw(&logits[row * vocab..(row + 1) * vocab], uniforms[row], threads)
                .map_or(-1, |t| t as i64);
        }
    } else {
        for_each_share(out, 1, 1, threads, |range, picks| {
            for (row, pick) in range.zip(picks.iter_mut()) {
                *pick =
                    draw(&logits[row * vocab..(row + 1) * vocab], uniforms[row], 1).map_or(-1, |t| t as i64);
            }
        });
    }
    if let Some(row) = out.iter().position(|&pick| pick < 0) {
        let limit = "at least one finite logit".to_string();
        return Err(KernelError::Param { name: "logits", limit, value: format!("row {row} has none") });
    }
    Ok(())
}

/// The token of `row` whose cumulative mass first passes `u` × the row's total (`None` when the
/// row has no mass), its two passes (the block maxima, then the block masses) split over up to
/// `threads` block by block: each block's values do not depend on the split, so neither does
/// the draw.
fn draw(row: &[f32], u: f64, threads: usize) -> Option<usize> {
    let blocks = row.len().div_ceil(BLOCK);
    let mut maxes = vec![f32::NEG_INFINITY; blocks];
    for_each_share(&mut maxes, 1, MIN_BLOCKS_PER_THREAD, threads, |range, out| {
        blocks_max(&row[range.start * BLOCK..row.len().min(range.end * BLOCK)], out)
    });
    let max = maxes.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    if !max.is_finite() {
        return None;
    }
    let mut masses = vec![0.0f64; blocks];
    for_each_share(&mut masses, 1, MIN_BLOCKS_PER_THREAD, threads, |range, out| {
        blocks_mass(&row[range.start * BLOCK..row.len().min(range.end * BLOCK)], max, out)
    });
    pick(row, u, max, &masses)
}

/// The index of `row`'s first largest value, or of its first NaN, as torch's argmax (and the
/// sampler's greedy rows) take it. The maximum comes from the lanes of [`row_max`] (vectorized,
/// NaN passed over), then the first index holding it; a row with a NaN or an infinity, where
/// those lanes cannot be trusted, is walked one value at a time.
pub fn argmax<T: Element>(row: &[T]) -> usize {
    let (max, finite) = max_and_finite(row);
    let target = |x: f32| if finite { x == max } else { x.is_nan() };
    if let Some(i) = row.iter().position(|x| target(x.to_f32())) {
        return i;
    }
    // Not finite and no NaN: infinities; the plain maximum (the first of equal ones) is right.
    let mut best = 0;
    for (i, x) in row.iter().enumerate() {
        if x.to_f32() > row[best].to_f32() {
            best = i;
        }
    }
    best
}

multiversion!(fn max_and_finite<T>(row: &[T]) -> (f32, bool) => max_and_finite_body);

/// `row`'s maximum and whether every value is finite (`x - x` is 0 only for those).
#[inline(always)]
#[allow(clippy::eq_op)]
fn max_and_finite_body<T: Element>(row: &[T]) -> (f32, bool) {
    let mut zeros = [0.0f32; LANES];
    for chunk in row.chunks(LANES) {
        for (z, x) in zeros.iter_mut().zip(chunk) {
            let x = x.to_f32();
            *z += x - x;
        }
    }
    (row_max(row), zeros.iter().all(|z| *z == 0.0))
}

// Compiled for the widest vectors the CPU has: the two passes are the draw's time, and `exp`
// vectorizes. Plain loops inside: an iterator adapter's `fold` is a function of its own,
// compiled without the caller's vector features (it ran the exponentials four lanes wide).
multiversion!(fn blocks_max<T>(row: &[T], out: &mut [f32]) => blocks_max_body);
multiversion!(fn blocks_mass<T>(row: &[T], max: f32, out: &mut [f64]) => blocks_mass_body);

/// Each [`BLOCK`] of `row`'s maximum into `out` (generic only to share `multiversion!`: the
/// logits are f32).
#[inline(always)]
fn blocks_max_body<T: Element>(row: &[T], out: &mut [f32]) {
    for (block, out) in row.chunks(BLOCK).zip(out) {
        *out = row_max(block);
    }
}

/// Each [`BLOCK`] of `row`'s mass at `max` into `out`.
#[inline(always)]
fn blocks_mass_body<T: Element>(row: &[T], max: f32, out: &mut [f64]) {
    for (block, out) in row.chunks(BLOCK).zip(out) {
        *out = block_mass(block, max);
    }
}

/// The draw from the row's maximum and block masses: the first block whose cumulative mass
/// passes `u` × the total, then the token in it.
fn pick(row: &[f32], u: f64, max: f32, masses: &[f64]) -> Option<usize> {
    let total: f64 = masses.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return None;
    }
    let target = u * total;
    // The first block whose cumulative mass passes `target`, and the mass before it; rounding
    // can leave `target` past the last sum, and then the last block with mass takes it.
    let (mut at, mut found) = (0.0, None);
    for (b, &mass) in masses.iter().enumerate() {
        if mass > 0.0 {
            found = Some((b, at));
            if at + mass > target {
                break;
            }
        }
        at += mass;
    }
    let (b, before) = found?;
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
fn row_max<T: Element>(row: &[T]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (m, x) in lanes.iter_mut().zip(chunk) {
            let x = x.to_f32();
            *m = if x > *m { x } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for x in tail.iter().map(|x| x.to_f32()).chain(lanes) {
        max = if x > max { x } else { max };
    }
    max
}

/// Σ `exp(logit - max)` over a block, in float32 lanes, as float64.
#[inline(always)]
fn block_mass<T: Element>(block: &[T], max: f32) -> f64 {
    let mut lanes = [0.0f32; LANES];
    let chunks = block.chunks_exact(LANES);
    let mut sum = 0.0f64;
    for x in chunks.remainder() {
        sum += f64::from(weight(x.to_f32(), max));
    }
    for chunk in chunks {
        for (s, x) in lanes.iter_mut().zip(chunk) {
            *s += weight(x.to_f32(), max);
        }
    }
    for s in lanes {
        sum += f64::from(s);
    }
    sum
}

#[cfg(test)]
mod tests {
    #[test]
    fn argmax_takes_the_first_maximum_or_the_first_nan_as_torch_does() {
        use super::argmax;
        let mut row: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 * 0.5 - 20.0).collect();
        let max = row.iter().cloned().fold(f32::MIN, f32::max);
        assert_eq!(argmax(&row), row.iter().position(|&x| x == max).unwrap());
        row[900] = 1e9;
        row[950] = 1e9;
        assert_eq!(argmax(&row), 900);
        row[999] = f32::NAN;
        assert_eq!(argmax(&row), 999);
        row[3] = f32::INFINITY;
        assert_eq!(argmax(&row), 999);
        row[999] = 0.0;
        assert_eq!(argmax(&row), 3);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[crate::Bf16::from_f32(1.0), crate::Bf16::from_f32(2.0)]), 1);
    }

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
    fn a_row_split_over_the_team_draws_what_one_thread_draws() {
        // A vocabulary wide enough to split (and a short last block), some tokens removed.
        let vocab = 2 * MIN_BLOCKS_PER_THREAD * BLOCK + 77;
        let mut row: Vec<f32> = values(vocab, 9).iter().map(|v| 6.0 * v).collect();
        row.iter_mut().step_by(7).for_each(|l| *l = f32::NEG_INFINITY);
        for k in 0..50 {
            let u = (k as f64 + 0.25) / 50.0;
            let (mut split, mut one) = ([0i64], [0i64]);
            sample_rows(&row, vocab, &[u], &mut split, 2).unwrap();
            sample_rows(&row, vocab, &[u], &mut one, 1).unwrap();
            assert_eq!(split, one, "u {u}");
            assert_eq!(draw(&row, u, 2), draw(&row, u, 1));
        }
        assert_eq!(draw(&[f32::NEG_INFINITY; 2 * MIN_BLOCKS_PER_THREAD * BLOCK], 0.5, 2), None);
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
