//! A step's attention inside the stack: the rows' rotary and cache writes, then decode rows
//! through `attention::paged_decode` or a prompt chunk through `prefill::paged_prefill`.

use super::{DecodeStep, DecoderLayer, DecoderShape, LayerCache, Scratch};
use crate::attention::{paged_decode, DecodeInputs, DecodeOptions, DecodeShape, KvScales};
use crate::cache::{write_kv, CacheWriteShape};
use crate::error::{check_len, KernelError};
use crate::prefill::{
    paged_prefill, supports as prefill_supports, PrefillInputs, PrefillOptions, PrefillShape,
};
use crate::rotary::{rotate_neox, RotaryShape};
use crate::simd::SimdElement;

/// `scratch.attn = attention(rotary(q), cache)` from `scratch.normed`, the keys and values
/// written to the cache first.
pub(super) fn attention<T: SimdElement>(
    layer: &DecoderLayer<'_, T>,
    cache: &mut LayerCache<'_, T>,
    s: &DecoderShape,
    step: &DecodeStep<'_, T>,
    scratch: &mut Scratch<T>,
    threads: usize,
) -> Result<(), KernelError> {
    let rows = step.positions.len();
    let (q_size, kv_size, width) = (s.q_size(), s.kv_size(), s.qkv_size());
    layer.qkv.forward(&scratch.normed, rows, layer.qkv_bias, &mut scratch.qkv, threads)?;
    let rotary = |heads| RotaryShape {
        rows,
        row_stride: width,
        heads,
        head_size: s.head_dim,
        rotary_dim: s.rotary_dim,
    };
    // Rows `width` apart from `offset` on, the last one ending after its `len` elements.
    let strided = |offset: usize, len: usize| &scratch.qkv[offset..][..(rows - 1) * width + len];
    let (q, k, v) = (strided(0, q_size), strided(q_size, kv_size), strided(q_size + kv_size, kv_size));
    rotate_neox(q, step.positions, step.cos_sin, &mut scratch.q, rotary(s.num_heads), threads)?;
    rotate_neox(k, step.positions, step.cos_sin, &mut scratch.k, rotary(s.num_kv_heads), threads)?;
    let write = CacheWriteShape { tokens: rows, width: kv_size, key_stride: kv_size, value_stride: width };
    write_kv(&scratch.k, v, step.slot_mapping, cache.key, cache.value, write)?;
    if let Some(num_computed) = step.chunk_after {
        let shape = PrefillShape {
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            block_size: step.block_size,
            query_len: rows,
            num_computed,
        };
        let inputs = PrefillInputs {
            query: &scratch.q,
            key_cache: cache.key,
            value_cache: cache.value,
            block_table: &step.block_tables[..step.max_blocks_per_seq],
        };
        let options = PrefillOptions { scale: s.scale, sliding_window: None };
        return paged_prefill(inputs, shape, options, &mut scratch.attn, threads);
    }
    let inputs = DecodeInputs {
        query: &scratch.q,
        key_cache: cache.key,
        value_cache: cache.value,
        scales: KvScales { key: 1.0, value: 1.0 },
        block_tables: step.block_tables,
        seq_lens: step.seq_lens,
    };
    let shape = DecodeShape {
        num_heads: s.num_heads,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        block_size: step.block_size,
        max_blocks_per_seq: step.max_blocks_per_seq,
    };
    let options = DecodeOptions { scale: s.scale, sliding_window: None, soft_cap: None };
    paged_decode(inputs, shape, options, &mut scratch.attn, threads)
}

/// A prompt chunk's request: one, whose context ends with the chunk, in whole blocks of its
/// table, on a CPU and head size the prefill kernel takes (checked here, before any cache is
/// written, rather than by the kernel in the first layer).
pub(super) fn check_chunk<T>(
    s: &DecoderShape,
    step: &DecodeStep<'_, T>,
    num_computed: usize,
) -> Result<(), KernelError> {
    let rows = step.positions.len();
    check_len("seq_lens", step.seq_lens.len(), 1)?;
    if step.seq_lens[0] as usize != num_computed + rows {
        let limit = format!("the cached {num_computed} plus the chunk's {rows} tokens");
        return Err(KernelError::Value { name: "seq_lens", limit, value: step.seq_lens[0].into() });
    }
    if !prefill_supports(s.head_dim) {
        let limit = "a positive multiple of 64, on a CPU with AVX-512 (the prefill kernel's)".into();
        return Err(KernelError::Value { name: "head_dim", limit, value: s.head_dim as i64 });
    }
    if step.block_tables.len() < step.max_blocks_per_seq
        || step.max_blocks_per_seq * step.block_size < num_computed + rows
    {
        let limit = format!("one row of {} blocks covering the context", step.max_blocks_per_seq);
        return Err(KernelError::Value {
            name: "block_tables",
            limit,
            value: step.block_tables.len() as i64,
        });
    }
    Ok(())
}
