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
