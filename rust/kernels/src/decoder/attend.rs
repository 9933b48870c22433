//! A step's attention inside the stack: the rows' rotary and cache writes, then each request's
//! attention. Requests of one row (decode rows) attend together through
//! `attention::paged_decode`, gathered where prompt chunks lie between them, as the layer path's
//! `StepRows` gathers them; each longer request (a prompt chunk) attends causally over its
//! context through `prefill::paged_prefill`. A served step usually mixes both: a new prompt
//! beside the running requests' next tokens.

use super::{DecodeStep, DecoderLayer, DecoderShape, LayerCache, Scratch};
use crate::attention::{paged_decode, DecodeInputs, DecodeOptions, DecodeShape, KvScales};
use crate::cache::{write_kv, CacheWriteShape};
use crate::error::{check_len, KernelError};
use crate::prefill::{
    paged_prefill, supports as prefill_supports, PrefillInputs, PrefillOptions, PrefillShape,
};
use crate::rotary::{rotate_neox, RotaryShape};
use crate::simd::SimdElement;

/// How a step's requests attend, worked out once per step for every layer.
pub(super) struct Requests {
    /// The rows of the requests with one row, in order.
    decode_rows: Vec<usize>,
    /// Their block tables and context lengths, gathered where they are not the step's first
    /// requests and rows; `None` where they are (the decode-only step, and the scheduler's order:
    /// running requests first), and their queries, tables and lengths are read in place.
    gathered: Option<(Vec<i32>, Vec<i32>)>,
    chunks: Vec<Chunk>,
}

/// A request's prompt chunk: `rows` rows from `start`, after its `num_computed` cached tokens.
struct Chunk {
    request: usize,
    start: usize,
    rows: usize,
    num_computed: usize,
}

impl Requests {
    /// The split of a step `check_requests` accepted.
    pub(super) fn new<T>(step: &DecodeStep<'_, T>) -> Self {
        let Some(starts) = step.query_start_loc else {
            let rows = step.positions.len();
            return Requests { decode_rows: (0..rows).collect(), gathered: None, chunks: Vec::new() };
        };
        let (mut decodes, mut chunks) = (Vec::new(), Vec::new());
        for (request, pair) in starts.windows(2).enumerate() {
            let (start, rows) = (pair[0] as usize, (pair[1] - pair[0]) as usize);
            if rows == 1 {
                decodes.push(request);
            } else {
                let num_computed = step.seq_lens[request] as usize - rows;
                chunks.push(Chunk { request, start, rows, num_computed });
            }
        }
        let mb = step.max_blocks_per_seq;
        let gathered = (!decodes.iter().enumerate().all(|(i, &r)| r == i)).then(|| {
            let tables = decodes.iter().flat_map(|&r| &step.block_tables[r * mb..][..mb]).copied().collect();
            (tables, decodes.iter().map(|&r| step.seq_lens[r]).collect())
        });
        let decode_rows = decodes.iter().map(|&r| starts[r] as usize).collect();
        Requests { decode_rows, gathered, chunks }
    }

    /// The decode rows' block tables and context lengths.
    fn decode_tables_and_lens<'s, T>(&'s self, step: &'s DecodeStep<'_, T>) -> (&'s [i32], &'s [i32]) {
        match &self.gathered {
            Some((tables, lens)) => (tables, lens),
            None => {
                let decodes = self.decode_rows.len();
                (&step.block_tables[..decodes * step.max_blocks_per_seq], &step.seq_lens[..decodes])
            }
        }
    }
}

/// `scratch.attn = attention(rotary(q), cache)` from `scratch.normed`, the keys and values
/// written to the cache first.
pub(super) fn attention<T: SimdElement>(
    layer: &DecoderLayer<'_, T>,
    cache: &mut LayerCache<'_, T>,
    s: &DecoderShape,
    step: &DecodeStep<'_, T>,
    requests: &Requests,
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
    decode_attention(cache, s, step, requests, scratch, threads)?;
    for chunk in &requests.chunks {
        let shape = PrefillShape {
            num_heads: s.num_heads,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            block_size: step.block_size,
            query_len: chunk.rows,
            num_computed: chunk.num_computed,
        };
        let inputs = PrefillInputs {
            query: &scratch.q[chunk.start * q_size..][..chunk.rows * q_size],
            key_cache: cache.key,
            value_cache: cache.value,
            block_table: &step.block_tables[chunk.request * step.max_blocks_per_seq..]
                [..step.max_blocks_per_seq],
        };
        let options = PrefillOptions { scale: s.scale, sliding_window: None };
        let out = &mut scratch.attn[chunk.start * q_size..][..chunk.rows * q_size];
        paged_prefill(inputs, shape, options, out, threads)?;
    }
    Ok(())
}

/// The decode rows' attention, in one call of the decode kernel.
fn decode_attention<T: SimdElement>(
    cache: &LayerCache<'_, T>,
    s: &DecoderShape,
    step: &DecodeStep<'_, T>,
    requests: &Requests,
    scratch: &mut Scratch<T>,
    threads: usize,
) -> Result<(), KernelError> {
    let (decodes, q_size) = (requests.decode_rows.len(), s.q_size());
    if decodes == 0 {
        return Ok(());
    }
    let shape = DecodeShape {
        num_heads: s.num_heads,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        block_size: step.block_size,
        max_blocks_per_seq: step.max_blocks_per_seq,
    };
    let options = DecodeOptions { scale: s.scale, sliding_window: None, soft_cap: None };
    let (block_tables, seq_lens) = requests.decode_tables_and_lens(step);
    let inputs = |query| DecodeInputs {
        query,
        key_cache: &*cache.key,
        value_cache: &*cache.value,
        scales: KvScales { key: 1.0, value: 1.0 },
        block_tables,
        seq_lens,
    };
    if requests.gathered.is_none() {
        let (query, out) = (&scratch.q[..decodes * q_size], &mut scratch.attn[..decodes * q_size]);
        return paged_decode(inputs(query), shape, options, out, threads);
    }
    let gathered: Vec<T> =
        requests.decode_rows.iter().flat_map(|&row| &scratch.q[row * q_size..][..q_size]).copied().collect();
    let mut out = vec![T::from_f32(0.0); decodes * q_size];
    paged_decode(inputs(&gathered), shape, options, &mut out, threads)?;
    for (&row, values) in requests.decode_rows.iter().zip(out.chunks_exact(q_size)) {
        scratch.attn[row * q_size..][..q_size].copy_from_slice(values);
    }
    Ok(())
}

/// The step's requests, before any cache is written: without `query_start_loc` one row each;
/// with it, rows that add up, each request's context at least its rows, and every prompt chunk
/// (a request of several rows) on a CPU and head size the prefill kernel takes and in whole
/// blocks of its table (checked here rather than by the kernel in the first layer).
pub(super) fn check_requests<T>(s: &DecoderShape, step: &DecodeStep<'_, T>) -> Result<(), KernelError> {
    let rows = step.positions.len();
    let Some(starts) = step.query_start_loc else {
        return check_len("seq_lens", step.seq_lens.len(), rows);
    };
    let requests = step.seq_lens.len();
    check_len("query_start_loc", starts.len(), requests + 1)?;
    if starts[0] != 0 || starts[requests] as usize != rows {
        let limit = format!("from 0 to the step's {rows} rows");
        return Err(KernelError::Value { name: "query_start_loc", limit, value: starts[requests].into() });
    }
    let mb = step.max_blocks_per_seq;
    if step.block_tables.len() < requests * mb {
        let limit = format!("{requests} rows of {mb} blocks, one per request");
        return Err(KernelError::Value {
            name: "block_tables",
            limit,
            value: step.block_tables.len() as i64,
        });
    }
    for (request, pair) in starts.windows(2).enumerate() {
        let (len, context) = (pair[1] - pair[0], step.seq_lens[request]);
        if len < 1 {
            let limit = format!("increasing: request {request} has no rows");
            return Err(KernelError::Value { name: "query_start_loc", limit, value: pair[1].into() });
        }
        if context < len {
            let limit = format!("at least request {request}'s {len} rows");
            return Err(KernelError::Value { name: "seq_lens", limit, value: context.into() });
        }
        if len > 1 {
            check_chunk(s, step, context as usize)?;
        }
    }
    Ok(())
}

/// A prompt chunk's context: covered by its table's blocks, attended by the prefill kernel.
fn check_chunk<T>(s: &DecoderShape, step: &DecodeStep<'_, T>, context: usize) -> Result<(), KernelError> {
    if !prefill_supports(s.head_dim) {
        let limit = "a positive multiple of 64, on a CPU with AVX-512 (the prefill kernel's)".into();
        return Err(KernelError::Value { name: "head_dim", limit, value: s.head_dim as i64 });
    }
    if step.max_blocks_per_seq * step.block_size < context {
        let limit = format!("{} blocks of {} tokens per request", step.max_blocks_per_seq, step.block_size);
        return Err(KernelError::Value { name: "seq_lens", limit, value: context as i64 });
    }
    Ok(())
}
