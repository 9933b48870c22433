//! Causal attention of one request's query chunk (a prompt, or a chunk of one) over its context in
//! the block-paged cache: the prefill counterpart of [`crate::attention`].
//!
//! torch's fused CPU attention reached ~50-65 GFLOP/s on a Qwen2-0.5B prompt, a quarter of
//! the machine's multiply-add peak, after the keys and values were gathered out of the cache and
//! copied into its layout. Here the request's keys are transposed once per call into
//! `[kv_heads, head_dim, tokens]`, so a score tile is a small matrix product with the tokens in
//! the vector lanes, and values are read where they lie; softmax is online (flash attention), so
//! no score matrix is ever written out. The query heads sharing a KV head are rows of the same
//! tiles, so each key and value is loaded once for the whole group.
//!
//! AVX-512 only (module `avx512`), for head sizes that are a multiple of 64; elsewhere the caller
//! keeps torch's attention.

use std::ops::Range;

use crate::error::{check_len, KernelError};
use crate::openmp::for_each_weighted_share;
use crate::paged;
use crate::simd::SimdElement;

#[cfg(target_arch = "x86_64")]
mod avx512;

/// Sizes of one request's prefill.
#[derive(Clone, Copy, Debug)]
pub struct PrefillShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Query tokens in the chunk.
    pub query_len: usize,
    /// Context tokens before the chunk (a cached prefix or earlier chunks): the chunk's first
    /// token sits at this position.
    pub num_computed: usize,
}

impl PrefillShape {
    /// Context tokens the chunk attends over, its own included.
    fn context_len(&self) -> usize {
        self.num_computed + self.query_len
    }
}

/// One request's inputs; the chunk's keys and values must already be in the caches.
#[derive(Clone, Copy)]
pub struct PrefillInputs<'a, T> {
    /// `[query_len, num_heads, head_dim]`.
    pub query: &'a [T],
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub key_cache: &'a [T],
    /// Same layout as `key_cache`.
    pub value_cache: &'a [T],
    /// The request's block ids, at least enough for its context.
    pub block_table: &'a [i32],
}

/// What changes the scores.
#[derive(Clone, Copy, Debug)]
pub struct PrefillOptions {
    /// Multiplier of `q . k`.
    pub scale: f32,
    /// A query at position `p` sees keys at positions `> p - window` only.
    pub sliding_window: Option<usize>,
}

impl PrefillOptions {
    /// The context positions a query at position `pos` sees.
    fn visible(&self, pos: usize) -> Range<usize> {
        paged::visible(pos + 1, self.sliding_window)
    }
}

/// Query positions per thread, at least: the row tiles span a few positions each.
const MIN_POSITIONS_PER_THREAD: usize = 8;

/// Whether [`paged_prefill`] runs on this CPU for this head size.
pub fn supports(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx512::supports(head_dim)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
    }
}

/// Writes `out` (`[query_len, num_heads, head_dim]`), the attention of each query token over the
/// context positions it sees, split over up to `threads` by query position. Shares are of equal
/// visible context rather than equal position counts, since the last positions see the most.
pub fn paged_prefill<T: SimdElement>(
    inputs: PrefillInputs<'_, T>,
    shape: PrefillShape,
    options: PrefillOptions,
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    validate(&inputs, &shape, &options, out.len())?;
    let costs: Vec<usize> =
        (0..shape.query_len).map(|i| options.visible(shape.num_computed + i).len()).collect();
    let row_len = shape.num_heads * shape.head_dim;
    let job = Job { inputs, shape, options };
    for_each_weighted_share(out, row_len, &costs, MIN_POSITIONS_PER_THREAD, threads, |positions, out| {
        job.run(positions, out)
    });
    Ok(())
}

/// A validated call.
struct Job<'a, T> {
    inputs: PrefillInputs<'a, T>,
    shape: PrefillShape,
    options: PrefillOptions,
}

impl<T: SimdElement> Job<'_, T> {
    /// The query positions `positions` (indices into the chunk), written to `out`, their rows.
    fn run(&self, positions: Range<usize>, out: &mut [T]) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `validate` checked the CPU, the head size and every buffer's extent.
        unsafe {
            avx512::attend(self, positions, out)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unreachable!("validate refuses every call off x86-64 ({positions:?}, {})", out.len())
    }

    /// Element offset of context position `t`'s slot: its `kv_heads x head_dim` keys, in order.
    fn slot(&self, t: usize) -> usize {
        let s = &self.shape;
        paged::slot(self.inputs.block_table, t, s.block_size, s.num_kv_heads * s.head_dim)
    }
}

fn validate<T>(
    inputs: &PrefillInputs<'_, T>,
    s: &PrefillShape,
    options: &PrefillOptions,
    out_len: usize,
) -> Result<(), KernelError> {
    if s.query_len == 0 {
        return Err(KernelError::Value { name: "query_len", limit: "> 0".into(), value: 0 });
    }
    if !supports(s.head_dim) {
        let limit = "a positive multiple of 64, on a CPU with AVX-512".into();
        return Err(KernelError::Value { name: "head_dim", limit, value: s.head_dim as i64 });
    }
    paged::check_heads(s.num_heads, s.num_kv_heads, s.block_size, options.sliding_window)?;
    let row_len = s.num_heads * s.head_dim;
    check_len("query", inputs.query.len(), s.query_len * row_len)?;
    check_len("out", out_len, s.query_len * row_len)?;
    let block_elems = s.block_size * s.num_kv_heads * s.head_dim;
    let num_blocks = paged::check_caches(inputs.key_cache.len(), inputs.value_cache.len(), block_elems)?;
    let used = s.context_len().div_ceil(s.block_size);
    if inputs.block_table.len() < used {
        let limit = format!(">= {used} blocks for a context of {} tokens", s.context_len());
        return Err(KernelError::Value {
            name: "block_table",
            limit,
            value: inputs.block_table.len() as i64,
        });
    }
    paged::check_block_ids("block_table", &inputs.block_table[..used], num_blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_near, reference_attention, values};

    /// One request's chunk over shuffled blocks of 16 tokens, with its f64 reference.
    struct Case {
        shape: PrefillShape,
        query: Vec<f32>,
        keys: Vec<f32>,
        values: Vec<f32>,
        table: Vec<i32>,
    }

    impl Case {
        fn new(heads: (usize, usize, usize), query_len: usize, num_computed: usize) -> Self {
            let (num_heads, num_kv_heads, head_dim) = heads;
            let block_size = 16;
            let blocks = (num_computed + query_len).div_ceil(block_size) + 3;
            let table = (0..blocks).map(|i| ((i * 5 + 2) % blocks) as i32).collect();
            let cache_len = blocks * block_size * num_kv_heads * head_dim;
            let shape =
                PrefillShape { num_heads, num_kv_heads, head_dim, block_size, query_len, num_computed };
            Case {
                shape,
                query: values(query_len * num_heads * head_dim, 11),
                keys: values(cache_len, 12),
                values: values(cache_len, 13),
                table,
            }
        }

        fn inputs(&self) -> PrefillInputs<'_, f32> {
            PrefillInputs {
                query: &self.query,
                key_cache: &self.keys,
                value_cache: &self.values,
                block_table: &self.table,
            }
        }

        fn reference(&self, options: &PrefillOptions) -> Vec<f32> {
            let s = &self.shape;
            let (dim, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
            let slot = |t: usize| paged::slot(&self.table, t, s.block_size, s.num_kv_heads * dim);
            let mut out = Vec::new();
            for i in 0..s.query_len {
                let visible: Vec<usize> = options.visible(s.num_computed + i).collect();
                for h in 0..s.num_heads {
                    let (q, kv) = (&self.query[(i * s.num_heads + h) * dim..][..dim], h / group * dim);
                    let keys: Vec<&[f32]> =
                        visible.iter().map(|&t| &self.keys[slot(t) + kv..][..dim]).collect();
                    let values: Vec<&[f32]> =
                        visible.iter().map(|&t| &self.values[slot(t) + kv..][..dim]).collect();
                    out.extend(reference_attention(q, &keys, &values, options.scale, None));
                }
            }
            out
        }
    }

    /// Groups of 7 (tiles of 6 rows cut across tokens), 1 and 4; head sizes of one and two value
    /// runs; fresh prompts and chunks after a cached prefix, shorter and longer than a key
    /// block; with and without a sliding window (one shorter than a block, so whole blocks are
    /// skipped by some rows of a tile and not others).
    #[test]
    fn matches_the_reference() {
        if !supports(64) {
            return;
        }
        for heads in [(14, 2, 64), (4, 4, 64), (8, 2, 128)] {
            for (query_len, num_computed) in [(1, 0), (5, 0), (13, 40), (150, 0), (70, 100), (1, 200)] {
                let case = Case::new(heads, query_len, num_computed);
                for window in [None, Some(20), Some(100)] {
                    let options =
                        PrefillOptions { scale: (heads.2 as f32).powf(-0.5), sliding_window: window };
                    let mut out = vec![0.0; case.query.len()];
                    paged_prefill(case.inputs(), case.shape, options, &mut out, 2).unwrap();
                    let what = format!("{heads:?} {query_len} after {num_computed}, window {window:?}");
                    assert_near(&out, &case.reference(&options), &what);
                }
            }
        }
    }

    #[test]
    fn refuses_what_it_cannot_do() {
        let case = Case::new((14, 2, 64), 4, 0);
        let options = PrefillOptions { scale: 0.125, sliding_window: None };
        let mut out = vec![0.0; case.query.len()];
        let mut shape = case.shape;
        shape.head_dim = 40;
        let err = paged_prefill(case.inputs(), shape, options, &mut out, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "head_dim", .. }), "{err}");
        if !supports(64) {
            return;
        }
        let short = PrefillInputs { block_table: &case.table[..0], ..case.inputs() };
        let err = paged_prefill(short, case.shape, options, &mut out, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "block_table", .. }), "{err}");
        let none = PrefillOptions { sliding_window: Some(0), ..options };
        let err = paged_prefill(case.inputs(), case.shape, none, &mut out, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "sliding_window", .. }), "{err}");
    }
}
