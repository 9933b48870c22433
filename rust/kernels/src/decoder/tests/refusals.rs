//! The stack's argument checks: each refusal comes before any cache is written.

use super::*;

#[test]
fn refuses_quantized_weights_with_bf16_activations_before_writing_the_cache() {
    let stack = [weights(1)];
    let w = &stack[0];
    let norms = bf16s(&w.norms[0]);
    let layers = [DecoderLayer {
        input_norm: &norms,
        post_attention_norm: &norms,
        qkv: w.qkv.linear(),
        qkv_bias: None,
        o: w.o.linear(),
        gate_up: w.gate_up.linear(),
        down: w.down.linear(),
    }];
    let seven = Bf16::from_f32(7.0);
    let (mut key, mut value) = (vec![seven; BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM], vec![seven; 1024]);
    let mut caches = [LayerCache { key: &mut key, value: &mut value }];
    let table = bf16s(&cos_sin());
    let tables = vec![0; BLOCKS_PER_SEQ];
    let step = DecodeStep { cos_sin: &table[..], ..one_token(&[0], &tables, &[]) };
    let (mut hidden, mut residual) = (vec![Bf16::from_f32(0.5); HIDDEN], vec![Bf16::default(); HIDDEN]);
    let err =
        decode_layers(&layers, None, &mut caches, shape(), step, &mut hidden, &mut residual, 1).unwrap_err();
    assert!(matches!(err, KernelError::Param { name: "qkv", .. }), "{err}");
    assert!(key.iter().all(|&v| v == seven));
}

/// One request's step at `position`, its block table all block 0.
fn one_token<'a, T>(position: &'a [i64], tables: &'a [i32], table: &'a [T]) -> DecodeStep<'a, T> {
    DecodeStep {
        positions: position,
        slot_mapping: &[0],
        block_tables: tables,
        max_blocks_per_seq: BLOCKS_PER_SEQ,
        seq_lens: &[1],
        block_size: BLOCK,
        cos_sin: table,
        query_start_loc: None,
    }
}

#[test]
fn refuses_a_position_past_the_rotary_table_before_writing_the_cache() {
    let stack = [weights(1)];
    let layers = [layer(&stack[0])];
    let (mut key, mut value) = (vec![7.0; BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM], vec![7.0; 1]);
    let mut caches = [LayerCache { key: &mut key, value: &mut value }];
    let table = cos_sin();
    let tables = vec![0; BLOCKS_PER_SEQ];
    let step = one_token(&[MAX_POS as i64], &tables, &table);
    let (mut hidden, mut residual) = (vec![0.5; HIDDEN], vec![0.0; HIDDEN]);
    let err =
        decode_layers(&layers, None, &mut caches, shape(), step, &mut hidden, &mut residual, 1).unwrap_err();
    assert!(matches!(err, KernelError::Value { name: "positions", .. }), "{err}");
    assert!(key.iter().all(|&v| v == 7.0));
}

#[test]
fn refuses_a_cache_per_layer_missing_and_a_mis_sized_weight() {
    let stack = [weights(1)];
    let layers = [layer(&stack[0])];
    let table = cos_sin();
    let tables = vec![0; BLOCKS_PER_SEQ];
    let step = one_token(&[0], &tables, &table);
    let (mut hidden, mut residual) = (vec![0.5; HIDDEN], vec![0.0; HIDDEN]);
    let err =
        decode_layers(&layers, None, &mut [], shape(), step, &mut hidden, &mut residual, 1).unwrap_err();
    assert_eq!(err, KernelError::Size { name: "caches", expected: 1, actual: 0 });
    let (mut key, mut value) = (vec![0.0; 1024], vec![0.0; 1024]);
    let mut caches = [LayerCache { key: &mut key, value: &mut value }];
    let wide = DecoderShape { intermediate: INTER + 1, ..shape() };
    let err =
        decode_layers(&layers, None, &mut caches, wide, step, &mut hidden, &mut residual, 1).unwrap_err();
    assert!(matches!(err, KernelError::Size { name: "gate_up", .. }), "{err}");
}

#[test]
fn refuses_requests_whose_rows_do_not_add_up_before_writing_the_cache() {
    let stack = [weights(1)];
    let layers = [layer(&stack[0])];
    let (mut key, mut value) = (vec![7.0; BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM], vec![7.0; 1]);
    let table = cos_sin();
    let tables = vec![0; 2 * BLOCKS_PER_SEQ];
    // Three rows: a decode row, then a two-row chunk after three cached tokens.
    let step = |query_start_loc, seq_lens| DecodeStep {
        positions: &[6, 3, 4],
        slot_mapping: &[6, 3, 4],
        seq_lens,
        query_start_loc: Some(query_start_loc),
        ..one_token(&[0], &tables, &table)
    };
    let (mut hidden, mut residual) = (vec![0.5; 3 * HIDDEN], vec![0.0; 3 * HIDDEN]);
    let mut run = |step, shape| {
        let mut caches = [LayerCache { key: &mut key, value: &mut value }];
        decode_layers(&layers, None, &mut caches, shape, step, &mut hidden, &mut residual, 1).unwrap_err()
    };
    let size = KernelError::Size { name: "query_start_loc", expected: 3, actual: 2 };
    assert_eq!(run(step(&[0, 3], &[7, 5]), shape()), size);
    let err = run(step(&[0, 1, 2], &[7, 5]), shape());
    assert!(err.to_string().contains("from 0 to the step's 3 rows"), "{err}");
    let err = run(step(&[0, 0, 3], &[7, 5]), shape());
    assert!(err.to_string().contains("request 0 has no rows"), "{err}");
    let err = run(step(&[0, 1, 3], &[7, 1]), shape());
    assert!(err.to_string().contains("at least request 1's 2 rows"), "{err}");
    let err = run(step(&[0, 1, 3], &[7, 5 + (BLOCKS_PER_SEQ * BLOCK) as i32]), shape());
    assert!(matches!(err, KernelError::Value { name: "seq_lens", .. }), "{err}");
    // Head size 16: the prefill kernel takes multiples of 64 only.
    let narrow = DecoderShape { head_dim: 16, rotary_dim: 16, ..shape() };
    assert!(matches!(
        run(step(&[0, 1, 3], &[7, 5]), narrow),
        KernelError::Value { name: "head_dim", value: 16, .. }
    ));
    assert!(key.iter().all(|&v| v == 7.0));
}
