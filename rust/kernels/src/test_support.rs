//! Inputs and reference results shared by the kernels' unit tests.

/// `len` values spread over [-1, 1], different for each `seed`.
pub(crate) fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

/// `x[rows, k] · w[n, k]ᵀ + bias`, accumulated in f64.
pub(crate) fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    rows: usize,
    n: usize,
    k: usize,
) -> Vec<f32> {
    let mut out = vec![0.0; rows * n];
    for r in 0..rows {
        for j in 0..n {
            let dot: f64 = (0..k).map(|i| f64::from(x[r * k + i]) * f64::from(w[j * k + i])).sum();
            out[r * n + j] = (dot + bias.map_or(0.0, |b| f64::from(b[j]))) as f32;
        }
    }
    out
}

/// One query head's attention in f64: `softmax(scale · q·k_t (soft-capped)) · v_t` over the
/// visible tokens' key and value rows, in order.
pub(crate) fn reference_attention(
    query: &[f32],
    keys: &[&[f32]],
    values: &[&[f32]],
    scale: f32,
    soft_cap: Option<f32>,
) -> Vec<f32> {
    let scores: Vec<f64> = keys
        .iter()
        .map(|k| {
            let dot: f64 = query.iter().zip(*k).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            let score = dot * f64::from(scale);
            soft_cap.map_or(score, |c| f64::from(c) * (score / f64::from(c)).tanh())
        })
        .collect();
    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
    let total: f64 = weights.iter().sum();
    (0..query.len())
        .map(|d| {
            let sum: f64 = values.iter().zip(&weights).map(|(v, w)| w * f64::from(v[d])).sum();
            (sum / total) as f32
        })
        .collect()
}

/// Panics naming the first element of `got` further than ~2e-5 (relative and absolute) from `want`.
pub(crate) fn assert_near(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 2e-5 + 2e-5 * w.abs(), "{what}: element {i}: {g} against {w}");
    }
}
