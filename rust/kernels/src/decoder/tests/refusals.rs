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
        chunk_after: None,
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
fn refuses_a_prompt_chunk_that_does_not_add_up_before_writing_the_cache() {
    let stack = [weights(1)];
    let layers = [layer(&stack[0])];
    let (mut key, mut value) = (vec![7.0; BLOCKS_PER_SEQ * BLOCK * KV_HEADS * DIM], vec![7.0; 1]);
    let table = cos_sin();
    let tables = vec![0; BLOCKS_PER_SEQ];
    // Two tokens after three cached ones: the context must be 5, for one request.
    let chunk = |seq_lens| DecodeStep {
        positions: &[3, 4],
        slot_mapping: &[3, 4],
        seq_lens,
        chunk_after: Some(3),
        ..one_token(&[0], &tables, &table)
    };
    let (mut hidden, mut residual) = (vec![0.5; 2 * HIDDEN], vec![0.0; 2 * HIDDEN]);
    let mut run = |step| {
        let mut caches = [LayerCache { key: &mut key, value: &mut value }];
        decode_layers(&layers, None, &mut caches, shape(), step, &mut hidden, &mut residual, 1).unwrap_err()
    };
    assert_eq!(run(chunk(&[5, 5])), KernelError::Size { name: "seq_lens", expected: 1, actual: 2 });
    let err = run(chunk(&[4]));
    assert!(err.to_string().contains("the cached 3 plus the chunk's 2 tokens"), "{err}");
    // Head size 16: the prefill kernel takes multiples of 64 only.
    assert!(matches!(run(chunk(&[5])), KernelError::Value { name: "head_dim", value: 16, .. }));
    assert!(key.iter().all(|&v| v == 7.0));
}
