//! Paged attention for decode rows: one query token per request, read against the request's
//! keys and values where they sit in the block-paged cache.
//!
//! The torch path gathers every row's blocks into a padded `[rows, max_len, kv_heads, dim]` copy,
//! converts it to f32 and masks the padding; here each request walks its own block table once,
//! reading each token's keys (and values) for all KV heads at once, as they sit side by side. The
//! query heads sharing a KV head (grouped-query attention) are done together, so each key and
//! value row is read once for the whole group. On x86, for head sizes that are a multiple of 16,
//! the intrinsics kernels do the work: AVX-512 (module `avx512`) where the CPU has it, else AVX2
//! (module `avx2`); otherwise the portable one (module `portable`).
//!
//! The cache's element type may differ from the query's and output's (an fp8 cache under a
//! bf16 or f32 model): keys and values are widened to f32 as they are read, the key scale is
//! folded into the query and the value scale into the softmax's normalisation, so a quantized
//! cache costs no extra pass.

pub use crate::cache::KvScales;
use crate::error::{check_len, KernelError};
use crate::openmp::for_each_weighted_share;
use crate::paged;
use crate::simd::{exp, load, SimdElement};
use portable::attend_portable;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod portable;

/// Sizes of a paged decode step.
#[derive(Clone, Copy, Debug)]
pub struct DecodeShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Width of each row of the block table.
    pub max_blocks_per_seq: usize,
}

/// What changes the scores.
#[derive(Clone, Copy, Debug)]
pub struct DecodeOptions {
    /// Multiplier of `q . k`.
    pub scale: f32,
    /// A query at position `p` sees keys at positions `> p - window` only.
    pub sliding_window: Option<usize>,
    /// Scores become `cap * tanh(score / cap)` before the softmax.
    pub soft_cap: Option<f32>,
}

/// One step's decode inputs: a query of `T` over a cache of `C` (`T` itself, or fp8).
#[derive(Clone, Copy)]
pub struct DecodeInputs<'a, T, C = T> {
    /// `[rows, num_heads, head_dim]`.
    pub query: &'a [T],
    /// `[num_blocks, block_size, num_kv_heads, head_dim]`.
    pub key_cache: &'a [C],
    /// Same layout as `key_cache`.
    pub value_cache: &'a [C],
    /// What the cache's keys and values are multiplied by when read (1.0 unless quantized).
    pub scales: KvScales,
    /// `[rows, max_blocks_per_seq]` block ids.
    pub block_tables: &'a [i32],
    /// `[rows]` context length including the query token.
    pub seq_lens: &'a [i32],
}

/// Requests per thread, at least, when threads take whole requests.
const MIN_ROWS_PER_THREAD: usize = 1;

/// Context tokens a step's requests must see in all before fewer requests than threads share
/// their KV heads out: below it the ~1.5 us of waking the team costs more than it saves.
/// Measured on the 2-core Xeon VM, SmolLM2 at batch 1 (3 KV heads, ~150 tokens): attention
/// ran on one core for ~10% of a decode step while the other waited.
const MIN_TOKENS_TO_SPLIT_HEADS: usize = 32;

/// Writes `out[row, head]`, the attention of each row's query over its first `seq_lens[row]`
/// cached tokens (`out`: `[rows, num_heads, head_dim]`), split over up to `threads`. Threads
/// take whole requests, all KV heads of one together: a token's keys for every head sit side by
/// side, so a request's blocks are read front to back. Shares are of equal context length
/// rather than of equal request count, since a step's contexts can differ tenfold. With fewer
/// requests than threads (batch-1 decode), threads take KV heads instead, each with the query
/// heads it serves.
pub fn paged_decode<T: SimdElement, C: SimdElement>(
    inputs: DecodeInputs<'_, T, C>,
    shape: DecodeShape,
    options: DecodeOptions,
    out: &mut [T],
    threads: usize,
) -> Result<(), KernelError> {
    validate(&inputs, &shape, &options, out.len())?;
    let costs: Vec<usize> =
        inputs.seq_lens.iter().map(|&len| visible(len as usize, &options).len()).collect();
    if costs.len() < threads && costs.iter().sum::<usize>() >= MIN_TOKENS_TO_SPLIT_HEADS {
        split_heads(&inputs, &shape, &options, &costs, out, threads);
        return Ok(());
    }
    let row_len = shape.num_heads * shape.head_dim;
    for_each_weighted_share(out, row_len, &costs, MIN_ROWS_PER_THREAD, threads, |rows, out| {
        for (row, out) in rows.zip(out.chunks_exact_mut(row_len)) {
            attend(&Unit::new(&inputs, &shape, &options, row), options.soft_cap, out);
        }
    });
    Ok(())
}

/// [`paged_decode`]'s work in units of one request's KV head (its query heads' outputs lie side
/// by side in `out`), shares of equal context length; a thread's share may end inside a request.
fn split_heads<T: SimdElement, C: SimdElement>(
    inputs: &DecodeInputs<'_, T, C>,
    shape: &DecodeShape,
    options: &DecodeOptions,
    costs: &[usize],
    out: &mut [T],
    threads: usize,
) {
    let kv_heads = shape.num_kv_heads;
    let head_len = shape.num_heads / kv_heads * shape.head_dim;
    let head_costs: Vec<usize> = costs.iter().flat_map(|&c| std::iter::repeat_n(c, kv_heads)).collect();
    for_each_weighted_share(out, head_len, &head_costs, 1, threads, |units, mut out| {
        let mut unit = units.start;
        while unit < units.end {
            let (row, first) = (unit / kv_heads, unit % kv_heads);
            let last = (units.end - row * kv_heads).min(kv_heads);
            let (piece, rest) = out.split_at_mut((last - first) * head_len);
            let heads = Unit::new(inputs, shape, options, row).kv_heads_only(first..last);
            attend(&heads, options.soft_cap, piece);
            (out, unit) = (rest, row * kv_heads + last);
        }
    });
}

/// The context positions a query at the end of `seq_len` tokens sees.
fn visible(seq_len: usize, options: &DecodeOptions) -> std::ops::Range<usize> {
    paged::visible(seq_len, options.sliding_window)
}

/// One request's work: its query heads, scaled, and where each visible context token's keys
/// (and values) start in the caches.
struct Unit<'a, C> {
    /// `[num_heads, head_dim]` f32, already multiplied by the scale and the key scale; the
    /// `group` heads sharing KV head `h` are `h * group .. (h + 1) * group`.
    query: Vec<f32>,
    key_cache: &'a [C],
    value_cache: &'a [C],
    /// Multiplies each output: the cache's value scale.
    value_scale: f32,
    /// Element offset of each visible token's slot: its `kv_heads x head_dim` keys, in order.
    slots: Vec<usize>,
    kv_heads: usize,
    group: usize,
    dim: usize,
}

impl<'a, C: SimdElement> Unit<'a, C> {
    fn new<T: SimdElement>(
        inputs: &DecodeInputs<'a, T, C>,
        shape: &DecodeShape,
        options: &DecodeOptions,
        row: usize,
    ) -> Self {
        let (dim, kv_heads) = (shape.head_dim, shape.num_kv_heads);
        let table = &inputs.block_tables[row * shape.max_blocks_per_seq..];
        let slots = visible(inputs.seq_lens[row] as usize, options)
            .map(|t| paged::slot(table, t, shape.block_size, kv_heads * dim))
            .collect();
        let row_len = shape.num_heads * dim;
        let mut query = vec![0.0f32; row_len];
        load(&inputs.query[row * row_len..][..row_len], &mut query);
        let scale = options.scale * inputs.scales.key;
        for q in query.iter_mut() {
            *q *= scale;
        }
        let group = shape.num_heads / kv_heads;
        Unit {
            query,
            key_cache: inputs.key_cache,
            value_cache: inputs.value_cache,
            value_scale: inputs.scales.value,
            slots,
            kv_heads,
            group,
            dim,
        }
    }
}

impl<C> Unit<'_, C> {
    /// This request's KV heads `heads` alone, with the query heads they serve: inside a token's
    /// slot the heads' keys (and values) sit side by side, so the slots move along by the heads
    /// left out and the kernels run unchanged.
    fn kv_heads_only(self, heads: std::ops::Range<usize>) -> Self {
        let (skip, head_len) = (heads.start * self.dim, self.group * self.dim);
        Unit {
            query: self.query[heads.start * head_len..heads.end * head_len].to_vec(),
            slots: self.slots.iter().map(|s| s + skip).collect(),
            kv_heads: heads.len(),
            ..self
        }
    }
}

/// One unit through the AVX-512 kernel, else the AVX2 one, where the CPU and head size allow,
/// else the portable one.
fn attend<T: SimdElement, C: SimdElement>(unit: &Unit<'_, C>, soft_cap: Option<f32>, out: &mut [T]) {
    #[cfg(target_arch = "x86_64")]
    if avx512::supports(unit.dim) {
        // SAFETY: the CPU has AVX-512F, the head size is supported, and `Unit::new` took its
        // rows from inputs `validate` checked.
        return unsafe { avx512::attend(unit, soft_cap, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has_avx2_fma() && avx2::supports(unit.dim) {
        // SAFETY: the CPU has AVX2 and FMA, the head size is supported, and `Unit::new` took its
        // rows from inputs `validate` checked.
        return unsafe { avx2::attend(unit, soft_cap, out) };
    }
    attend_portable(unit, soft_cap, out);
}

fn validate<T, C>(
    inputs: &DecodeInputs<'_, T, C>,
    s: &DecodeShape,
    options: &DecodeOptions,
    out_len: usize,
) -> Result<(), KernelError> {
    if s.head_dim == 0 {
        return Err(KernelError::Value { name: "head_dim", limit: "> 0".into(), value: 0 });
    }
    for (name, scale) in [("k_scale", inputs.scales.key), ("v_scale", inputs.scales.value)] {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(KernelError::Value {
                name,
                limit: "a finite number > 0".into(),
                value: scale as i64,
            });
        }
    }
    paged::check_heads(s.num_heads, s.num_kv_heads, s.block_size, options.sliding_window)?;
    let rows = inputs.seq_lens.len();
    check_len("query", inputs.query.len(), rows * s.num_heads * s.head_dim)?;
    check_len("out", out_len, rows * s.num_heads * s.head_dim)?;
    check_len("block_tables", inputs.block_tables.len(), rows * s.max_blocks_per_seq)?;
    let block_elems = s.block_size * s.num_kv_heads * s.head_dim;
    let num_blocks = paged::check_caches(inputs.key_cache.len(), inputs.value_cache.len(), block_elems)?;
    let capacity = s.max_blocks_per_seq * s.block_size;
    for (row, &len) in inputs.seq_lens.iter().enumerate() {
        if len <= 0 || len as usize > capacity {
            let limit = format!("in 1..={capacity} (block table width x block size)");
            return Err(KernelError::Value { name: "seq_lens", limit, value: len.into() });
        }
        let used = (len as usize).div_ceil(s.block_size);
        paged::check_block_ids(
            "block_tables",
            &inputs.block_tables[row * s.max_blocks_per_seq..][..used],
            num_blocks,
        )?;
    }
    Ok(())
}

/// Tokens per score tile of the portable kernel, and lanes of the shared softmax's max and sum:
/// two AVX2 registers of f32.
const TILE: usize = 16;

/// Soft-caps the scores if asked, replaces each by `exp(score - max)` and returns their sum: the
/// softmax of every kernel, short of the division. Inlined into each, so it is compiled with
/// their instructions. Max and sum go in [`TILE`] lanes: a sum in one float is a chain of
/// dependent adds, which took the AVX-512 kernel more time than its exponentials.
#[inline(always)]
fn softmax_numerators(scores: &mut [f32], soft_cap: Option<f32>) -> f32 {
    if let Some(cap) = soft_cap {
        for s in scores.iter_mut() {
            *s = cap * (*s / cap).tanh();
        }
    }
    let body = scores.len() / TILE * TILE;
    let mut lanes = [f32::NEG_INFINITY; TILE];
    for chunk in scores[..body].chunks_exact(TILE) {
        for (m, &s) in lanes.iter_mut().zip(chunk) {
            *m = m.max(s);
        }
    }
    let max = scores[body..].iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sums = [0.0f32; TILE];
    for chunk in scores[..body].chunks_exact_mut(TILE) {
        for (sum, s) in sums.iter_mut().zip(chunk) {
            *s = exp(*s - max);
            *sum += *s;
        }
    }
    let mut tail = 0.0;
    for s in &mut scores[body..] {
        *s = exp(*s - max);
        tail += *s;
    }
    sums.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests;
