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
