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
use crate::openmp::{for_each_weighted_share, share};
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

/// Context tokens a step's requests must see in all before fewer requests than threads split
/// their contexts: below it the ~1.5 us of waking the team costs more than it saves.
const MIN_TOKENS_TO_SPLIT: usize = 32;

/// Context tokens of one piece of a split context, at least: one score tile of the AVX-512
/// kernel.
const MIN_PIECE_TOKENS: usize = 16;

/// Writes `out[row, head]`, the attention of each row's query over its first `seq_lens[row]`
/// cached tokens (`out`: `[rows, num_heads, head_dim]`), split over up to `threads`. Threads
/// take whole requests, all KV heads of one together: a token's keys for every head sit side by
/// side, so a request's blocks are read front to back. Shares are of equal context length
/// rather than of equal request count, since a step's contexts can differ tenfold. With fewer
/// requests than threads (batch-1 decode), the requests' contexts are cut into pieces instead
/// (see [`split_context`]).
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
    if costs.len() < threads && costs.iter().sum::<usize>() >= MIN_TOKENS_TO_SPLIT {
        split_context(&inputs, &shape, &options, &costs, out, threads);
        return Ok(());
    }
    let row_len = shape.num_heads * shape.head_dim;
    for_each_weighted_share(out, row_len, &costs, MIN_ROWS_PER_THREAD, threads, |rows, out| {
        for (row, out) in rows.zip(out.chunks_exact_mut(row_len)) {
            let unit = Unit::new(&inputs, &shape, &options, row, 0..costs[row]);
            attend(&unit, options.soft_cap, out);
        }
    });
    Ok(())
}

/// [`paged_decode`] for fewer requests than threads: each request's visible context is cut into
/// pieces of consecutive tokens (about `threads` pieces in all, by context length, each of
/// [`MIN_PIECE_TOKENS`] or more), the pieces shared out by length, each attended on its own
/// with its heads' log softmax mass kept, and a request's pieces merged by those masses.
/// Threads then read equal spans of the cache, every KV head of a token at once, where taking
/// whole KV heads left SmolLM2's three on two threads at two to one. The sums are grouped
/// differently from one thread's, so the output differs from it by float rounding.
fn split_context<T: SimdElement, C: SimdElement>(
    inputs: &DecodeInputs<'_, T, C>,
    shape: &DecodeShape,
    options: &DecodeOptions,
    costs: &[usize],
    out: &mut [T],
    threads: usize,
) {
    let total: usize = costs.iter().sum();
    let pieces: Vec<(usize, std::ops::Range<usize>)> = costs
        .iter()
        .enumerate()
        .flat_map(|(row, &n)| {
            let parts = (threads * n).div_ceil(total.max(1)).min(n / MIN_PIECE_TOKENS).max(1);
            (0..parts).map(move |part| (row, share(n, part, parts)))
        })
        .collect();
    let (heads, row_len) = (shape.num_heads, shape.num_heads * shape.head_dim);
    // Each piece's outputs, then its heads' log masses.
    let piece_len = row_len + heads;
    let mut partial = vec![0.0f32; pieces.len() * piece_len];
    let lengths: Vec<usize> = pieces.iter().map(|(_, tokens)| tokens.len()).collect();
    for_each_weighted_share(&mut partial, piece_len, &lengths, 1, threads, |units, partial| {
        for (piece, partial) in units.zip(partial.chunks_exact_mut(piece_len)) {
            let (row, tokens) = pieces[piece].clone();
            let (values, log_mass) = partial.split_at_mut(row_len);
            let masses = attend(&Unit::new(inputs, shape, options, row, tokens), options.soft_cap, values);
            log_mass.copy_from_slice(&masses);
        }
    });
    let mut at = 0;
    for (row, out) in out.chunks_exact_mut(row_len).enumerate() {
        let count = pieces[at..].iter().take_while(|(r, _)| *r == row).count();
        merge_pieces(&partial[at * piece_len..][..count * piece_len], heads, shape.head_dim, out);
        at += count;
    }
}

/// One request's output from its pieces (each `heads x dim` outputs, then `heads` log masses):
/// per head, the pieces' outputs weighted by their share of the head's softmax mass.
fn merge_pieces<T: SimdElement>(pieces: &[f32], heads: usize, dim: usize, out: &mut [T]) {
    let piece_len = heads * dim + heads;
    let mut sum = vec![0.0f32; dim];
    for h in 0..heads {
        let log_mass = |p: &[f32]| p[heads * dim + h];
        let top = pieces.chunks_exact(piece_len).map(log_mass).fold(f32::NEG_INFINITY, f32::max);
        sum.fill(0.0);
        let mut weight = 0.0f32;
        for piece in pieces.chunks_exact(piece_len) {
            let w = (log_mass(piece) - top).exp();
            weight += w;
            for (s, v) in sum.iter_mut().zip(&piece[h * dim..][..dim]) {
                *s += w * v;
            }
        }
        for (o, s) in out[h * dim..][..dim].iter_mut().zip(&sum) {
            *o = T::from_f32(s / weight);
        }
    }
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
    /// Request `row`'s query over `tokens`, a range of the positions it sees (see [`visible`]:
    /// `0..n` is all `n` of them).
    fn new<T: SimdElement>(
        inputs: &DecodeInputs<'a, T, C>,
        shape: &DecodeShape,
        options: &DecodeOptions,
        row: usize,
        tokens: std::ops::Range<usize>,
    ) -> Self {
        let (dim, kv_heads) = (shape.head_dim, shape.num_kv_heads);
        let table = &inputs.block_tables[row * shape.max_blocks_per_seq..];
        let first = visible(inputs.seq_lens[row] as usize, options).start;
        let slots = (first + tokens.start..first + tokens.end)
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

/// One unit through the AVX-512 kernel, else the AVX2 one, where the CPU and head size allow,
/// else the portable one. Returns each query head's log softmax mass (see [`Softmax`]).
fn attend<T: SimdElement, C: SimdElement>(
    unit: &Unit<'_, C>,
    soft_cap: Option<f32>,
    out: &mut [T],
) -> Vec<f32> {
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
    attend_portable(unit, soft_cap, out)
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

/// The softmax of `heads` query heads' scores (head `h`'s `n` scores at `h * padded`), short
/// of the division: the scores become their numerators, and per head come back what the
/// kernels divide by (the value scale folded in) and the log of the head's mass
/// (`max + ln(sum)`), by which [`merge_pieces`] weighs pieces of one context.
struct Softmax {
    totals: Vec<f32>,
    log_masses: Vec<f32>,
}

impl Softmax {
    #[inline(always)]
    fn of(
        scores: &mut [f32],
        padded: usize,
        n: usize,
        heads: usize,
        soft_cap: Option<f32>,
        value_scale: f32,
    ) -> Self {
        let (mut totals, mut log_masses) = (Vec::with_capacity(heads), Vec::with_capacity(heads));
        for h in 0..heads {
            let (max, sum) = softmax_numerators(&mut scores[h * padded..][..n], soft_cap);
            totals.push(sum / value_scale);
            log_masses.push(max + sum.ln());
        }
        Softmax { totals, log_masses }
    }
}

/// Soft-caps the scores if asked, replaces each by `exp(score - max)` and returns the max and
/// their sum: the softmax of every kernel, short of the division. Inlined into each, so it is
/// compiled with their instructions. Max and sum go in [`TILE`] lanes: a sum in one float is a
/// chain of dependent adds, which took the AVX-512 kernel more time than its exponentials.
#[inline(always)]
fn softmax_numerators(scores: &mut [f32], soft_cap: Option<f32>) -> (f32, f32) {
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
    (max, sums.iter().sum::<f32>() + tail)
}

#[cfg(test)]
mod tests;
