//! The end of a decode step in the same call: the LM head over the normed rows and each row's
//! token, greedy or drawn.

use super::Linear;
use crate::element::{as_f32, Element};
use crate::error::{check_len, KernelError};
use crate::sample::{argmax, sample_rows};

/// The LM head over a decode step's normed rows (`normed`: `[rows, hidden]`, as
/// [`decode_layers`] leaves them with the final norm) and each row's token from its first
/// `vocab` logits (past them, a padded head's zero rows): `logits` (`[rows,
/// head.out_features()]`, scratch) gets the product; without `uniforms`, `tokens[row]` is the
/// row's greedy token (the first of equal maxima, a NaN counting as the largest, as torch's
/// argmax and the sampler's greedy rows take them); with them (`[rows]`, in `[0, 1)`), the
/// token [`sample_rows`] draws at `uniforms[row]` from the logits as they are (temperature 1,
/// nothing filtered), as the sampler's plain random rows do. The step then returns to Python
/// with its tokens, not a row of logits for the sampler.
pub fn sample_tokens<T: Element>(
    head: &Linear<'_>,
    normed: &[T],
    vocab: usize,
    logits: &mut [T],
    uniforms: Option<&[f64]>,
    tokens: &mut [i64],
    threads: usize,
) -> Result<(), KernelError> {
    let (rows, width) = (tokens.len(), head.out_features());
    if vocab == 0 || vocab > width {
        let limit = format!("in 1..={width} (the head's output features)");
        return Err(KernelError::Value { name: "vocab", limit, value: vocab as i64 });
    }
    check_len("normed", normed.len(), rows * head.in_features())?;
    check_len("logits", logits.len(), rows * width)?;
    head.forward(normed, rows, None, logits, threads)?;
    let Some(uniforms) = uniforms else {
        for (token, row) in tokens.iter_mut().zip(logits.chunks_exact(width)) {
            *token = argmax(&row[..vocab]) as i64;
        }
        return Ok(());
    };
    // The draw reads float32 rows exactly `vocab` long: the head's own where they are, else a copy.
    match as_f32(logits) {
        Some(rows) if width == vocab => sample_rows(rows, vocab, uniforms, tokens, threads),
        _ => {
            let rows: Vec<f32> =
                logits.chunks_exact(width).flat_map(|row| row[..vocab].iter().map(|v| v.to_f32())).collect();
            sample_rows(&rows, vocab, uniforms, tokens, threads)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::wq::{QWeight, WqWeight};
    use crate::test_support::{linear, values};

    const HIDDEN: usize = 32;

    #[test]
    fn sampled_tokens_are_the_head_s_argmax_or_its_draw_within_the_vocabulary() {
        // A 40-row int8 head whose last 8 rows are a padded vocabulary's: never taken.
        let q: Vec<i8> = values(40 * HIDDEN, 3).iter().map(|v| (v * 127.0).round() as i8).collect();
        let scales: Vec<f32> = values(40, 4).iter().map(|v| 0.02 + 0.01 * v.abs()).collect();
        let weight = WqWeight { q: QWeight::Int8(&q), scales: &scales, mins: None };
        let head = Linear::Wq { weight, out_features: 40, in_features: HIDDEN, group_size: HIDDEN };
        let dense: Vec<f32> = q.iter().enumerate().map(|(i, &q)| f32::from(q) * scales[i / HIDDEN]).collect();
        let normed = values(2 * HIDDEN, 11);
        let (mut logits, mut tokens) = (vec![0.0f32; 2 * 40], [0i64; 2]);
        sample_tokens(&head, &normed, 32, &mut logits, None, &mut tokens, 2).unwrap();
        let want = linear(&normed, &dense, None, 2, 40, HIDDEN);
        let rows: Vec<f32> = want.chunks_exact(40).flat_map(|row| row[..32].to_vec()).collect();
        for (row, &token) in rows.chunks_exact(32).zip(&tokens) {
            let best = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(row[token as usize], best, "{row:?}");
        }
        // Drawn as `sample_rows` draws from the vocabulary's logits, at each row's number.
        let uniforms = [0.3, 0.97];
        sample_tokens(&head, &normed, 32, &mut logits, Some(&uniforms), &mut tokens, 2).unwrap();
        let mut drawn = [0i64; 2];
        sample_rows(&rows, 32, &uniforms, &mut drawn, 2).unwrap();
        assert_eq!(tokens, drawn);
        let err = sample_tokens(&head, &normed, 41, &mut logits, None, &mut tokens, 1).unwrap_err();
        assert!(err.to_string().contains("`vocab` must be in 1..=40"), "{err}");
        let err = sample_tokens(&head, &normed[1..], 32, &mut logits, None, &mut tokens, 1).unwrap_err();
        assert_eq!(err, KernelError::Size { name: "normed", expected: 2 * HIDDEN, actual: 2 * HIDDEN - 1 });
    }
}
