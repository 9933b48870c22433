//! Steps mixing prompt chunks and decode rows, as a served step does: every row against the f64
//! recompute of its sequence, whichever order the requests come in.

use super::*;
use crate::prefill::supports as prefill_supports;

/// Each step: per request, its sequence and its rows' first position and count.
const STEPS: [&[(u32, usize, usize)]; 4] = [
    &[(0, 0, 5)],                       // a prompt alone
    &[(0, 5, 1), (1, 0, 3), (2, 0, 2)], // a decode row first, then two prompts
    &[(0, 6, 1), (1, 3, 4), (2, 2, 1)], // a chunk between decode rows: those gathered
    &[(1, 7, 1), (0, 7, 1), (2, 3, 1)], // decode rows only, requests in another order
];

#[test]
fn steps_mixing_prompt_chunks_and_decode_rows_match_the_recompute() {
    if !prefill_supports(DIM) {
        return; // the prefill kernel needs AVX-512; `check_requests` refuses chunks elsewhere
    }
    let stack = [weights(10), weights(20)];
    let layers: Vec<DecoderLayer<'_>> = stack.iter().map(layer).collect();
    let table = cos_sin();
    let cache_len = 3 * BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM;
    let mut kv: Vec<(Vec<f32>, Vec<f32>)> =
        (0..2).map(|_| (vec![0.0; cache_len], vec![0.0; cache_len])).collect();
    // Sequence `s` owns blocks `s * BLOCKS_PER_SEQ..`, in reverse order.
    let blocks = |seq: u32| -> Vec<i32> {
        let first = seq as i32 * BLOCKS_PER_SEQ as i32;
        (first..first + BLOCKS_PER_SEQ as i32).rev().collect()
    };
    let embed = |seq: u32, pos: usize| values(HIDDEN, 100 * seq + pos as u32);
    for requests in STEPS {
        let mut rows: Vec<(u32, usize)> = Vec::new();
        let (mut starts, mut seq_lens, mut tables) = (vec![0i32], Vec::new(), Vec::new());
        for &(seq, first, count) in requests {
            rows.extend((first..first + count).map(|pos| (seq, pos)));
            starts.push(rows.len() as i32);
            seq_lens.push((first + count) as i32);
            tables.extend(blocks(seq));
        }
        let positions: Vec<i64> = rows.iter().map(|&(_, pos)| pos as i64).collect();
        let slots: Vec<i64> = rows
            .iter()
            .map(|&(seq, pos)| i64::from(blocks(seq)[pos / BLOCK]) * BLOCK as i64 + (pos % BLOCK) as i64)
            .collect();
        let mut hidden: Vec<f32> = rows.iter().flat_map(|&(seq, pos)| embed(seq, pos)).collect();
        let mut residual = vec![0.0; hidden.len()];
        let step = DecodeStep {
            positions: &positions,
            slot_mapping: &slots,
            block_tables: &tables,
            max_blocks_per_seq: BLOCKS_PER_SEQ,
            seq_lens: &seq_lens,
            block_size: BLOCK,
            cos_sin: &table,
            query_start_loc: Some(&starts),
        };
        let mut caches: Vec<LayerCache<'_>> =
            kv.iter_mut().map(|(k, v)| LayerCache { key: k, value: v }).collect();
        decode_layers(&layers, None, &mut caches, shape(), step, &mut hidden, &mut residual, 2).unwrap();
        for (row, &(seq, pos)) in rows.iter().enumerate() {
            let tokens: Vec<Vec<f32>> = (0..=pos).map(|p| embed(seq, p)).collect();
            let (want_hidden, want_residual) = reference(&stack, &tokens, &table);
            let what = format!("sequence {seq} position {pos}");
            assert_close(&hidden[row * HIDDEN..][..HIDDEN], &want_hidden, &format!("{what} hidden"), 1e-3);
            assert_close(
                &residual[row * HIDDEN..][..HIDDEN],
                &want_residual,
                &format!("{what} residual"),
                1e-3,
            );
        }
    }
}
