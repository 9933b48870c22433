//! The block-paged KV cache as both attention kernels ([`crate::attention`] for decode rows,
//! [`crate::prefill`] for prompt chunks) address and check it.
//!
//! A cache is `[num_blocks, block_size, num_kv_heads, head_dim]`; a context position `t` of a
//! request lives in block `table[t / block_size]` at offset `t % block_size`, and its slot holds
//! the keys (or values) of every KV head side by side.

use std::ops::Range;

use crate::error::{check_len, KernelError};

/// Element offset of context position `t`'s slot, through the request's block `table`;
/// `slot_len` is `num_kv_heads * head_dim`.
#[inline]
pub(crate) fn slot(table: &[i32], t: usize, block_size: usize, slot_len: usize) -> usize {
    (table[t / block_size] as usize * block_size + t % block_size) * slot_len
}

/// The context positions `0..context_len` that the query at the last of them sees: all, or the
/// last `window`.
pub(crate) fn visible(context_len: usize, window: Option<usize>) -> Range<usize> {
    window.map_or(0, |w| context_len.saturating_sub(w))..context_len
}

/// Refuses zero sizes, query heads that are not a multiple of the KV heads, and an empty window.
pub(crate) fn check_heads(
    num_heads: usize,
    num_kv_heads: usize,
    block_size: usize,
    sliding_window: Option<usize>,
) -> Result<(), KernelError> {
    for (name, value) in [("num_kv_heads", num_kv_heads), ("block_size", block_size)] {
        if value == 0 {
            return Err(KernelError::Value { name, limit: "> 0".into(), value: 0 });
        }
    }
    if num_heads == 0 || !num_heads.is_multiple_of(num_kv_heads) {
        let limit = format!("a positive multiple of num_kv_heads ({num_kv_heads})");
        return Err(KernelError::Value { name: "num_heads", limit, value: num_heads as i64 });
    }
    if sliding_window == Some(0) {
        // A window of no tokens leaves nothing to attend to.
        return Err(KernelError::Value { name: "sliding_window", limit: "> 0".into(), value: 0 });
    }
    Ok(())
}

/// Checks that the key and value caches are whole blocks of `block_elems` elements and alike;
/// returns the block count.
pub(crate) fn check_caches(
    key_len: usize,
    value_len: usize,
    block_elems: usize,
) -> Result<usize, KernelError> {
    check_len("value_cache", value_len, key_len)?;
    if !key_len.is_multiple_of(block_elems) {
        check_len("key_cache", key_len, key_len / block_elems * block_elems)?;
    }
    Ok(key_len / block_elems)
}

/// Refuses a block id in `table` outside `0..num_blocks`, naming the parameter `name`.
pub(crate) fn check_block_ids(
    name: &'static str,
    table: &[i32],
    num_blocks: usize,
) -> Result<(), KernelError> {
    match table.iter().find(|&&b| b < 0 || b as usize >= num_blocks) {
        Some(&bad) => Err(KernelError::Value {
            name,
            limit: format!("a block id in 0..{num_blocks}"),
            value: bad.into(),
        }),
        None => Ok(()),
    }
}
