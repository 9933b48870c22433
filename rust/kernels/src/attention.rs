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
mod tests {
    use super::*;
    use crate::element::Element;
    use crate::test_support::{assert_near, reference_attention, values};

    /// A decode step over shuffled blocks of 16 tokens, with its f64 reference.
    #[derive(Clone)]
    struct Case {
        shape: DecodeShape,
        query: Vec<f32>,
        keys: Vec<f32>,
        values: Vec<f32>,
        tables: Vec<i32>,
        lens: Vec<i32>,
    }

    impl Case {
        fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize, lens: &[i32]) -> Self {
            let block_size = 16;
            let max_blocks_per_seq = lens.iter().map(|&l| (l as usize).div_ceil(block_size)).max().unwrap();
            let num_blocks = lens.len() * max_blocks_per_seq;
            // Block ids taken in a scrambled order, so a request's blocks are not adjacent.
            let tables = (0..num_blocks).map(|i| ((i * 7919) % num_blocks) as i32).collect();
            let cache_len = num_blocks * block_size * num_kv_heads * head_dim;
            let shape = DecodeShape { num_heads, num_kv_heads, head_dim, block_size, max_blocks_per_seq };
            Case {
                shape,
                query: values(lens.len() * num_heads * head_dim, 1),
                keys: values(cache_len, 2),
                values: values(cache_len, 3),
                tables,
                lens: lens.to_vec(),
            }
        }

        fn inputs(&self) -> DecodeInputs<'_, f32> {
            DecodeInputs {
                query: &self.query,
                key_cache: &self.keys,
                value_cache: &self.values,
                block_tables: &self.tables,
                seq_lens: &self.lens,
                scales: KvScales { key: 1.0, value: 1.0 },
            }
        }

        /// Softmax-weighted values in f64, position by position through the block table.
        fn reference(&self, options: &DecodeOptions) -> Vec<f32> {
            let s = &self.shape;
            let (dim, group) = (s.head_dim, s.num_heads / s.num_kv_heads);
            let mut out = Vec::new();
            for (row, &len) in self.lens.iter().enumerate() {
                let table = &self.tables[row * s.max_blocks_per_seq..];
                let slot = |t: usize| paged::slot(table, t, s.block_size, s.num_kv_heads * dim);
                let visible: Vec<usize> = visible(len as usize, options).collect();
                for h in 0..s.num_heads {
                    let (q, kv) = (&self.query[(row * s.num_heads + h) * dim..][..dim], h / group * dim);
                    let keys: Vec<&[f32]> =
                        visible.iter().map(|&t| &self.keys[slot(t) + kv..][..dim]).collect();
                    let values: Vec<&[f32]> =
                        visible.iter().map(|&t| &self.values[slot(t) + kv..][..dim]).collect();
                    out.extend(reference_attention(q, &keys, &values, options.scale, options.soft_cap));
                }
            }
            out
        }

        /// Each request through `kernel`, as `paged_decode` calls it.
        fn run(&self, options: &DecodeOptions, kernel: impl Fn(&Unit<'_, f32>, &mut [f32])) -> Vec<f32> {
            let row_len = self.shape.num_heads * self.shape.head_dim;
            let mut out = vec![0.0; self.lens.len() * row_len];
            let inputs = self.inputs();
            for (row, out) in out.chunks_exact_mut(row_len).enumerate() {
                kernel(&Unit::new(&inputs, &self.shape, options, row), out);
            }
            out
        }
    }

    fn options(head_dim: usize, sliding_window: Option<usize>, soft_cap: Option<f32>) -> DecodeOptions {
        DecodeOptions { scale: (head_dim as f32).powf(-0.5), sliding_window, soft_cap }
    }

    /// Every kernel this CPU runs, by name; each takes the head sizes `supports` admits.
    #[allow(clippy::type_complexity)]
    fn kernels(head_dim: usize) -> Vec<(&'static str, Box<dyn Fn(&Unit<'_, f32>, Option<f32>, &mut [f32])>)> {
        let mut all: Vec<(&'static str, Box<dyn Fn(&Unit<'_, f32>, Option<f32>, &mut [f32])>)> =
            vec![("portable", Box::new(attend_portable))];
        #[cfg(target_arch = "x86_64")]
        {
            if crate::simd::has_avx2_fma() && avx2::supports(head_dim) {
                // SAFETY: checked just above; the units come from `Case`'s consistent inputs.
                all.push(("avx2", Box::new(|u, c, o| unsafe { avx2::attend(u, c, o) })));
            }
            if avx512::supports(head_dim) {
                // SAFETY: as above.
                all.push(("avx512", Box::new(|u, c, o| unsafe { avx512::attend(u, c, o) })));
            }
        }
        all
    }

    /// Head layouts through every kernel: groups of 7 (one value pass), 8 and 9 (a pass of 7 and
    /// one of 1 or 2), 1 (no grouping); head sizes of one to eight vectors and one not a
    /// multiple of 16; contexts shorter than a tile, a tile plus one, and several blocks.
    #[test]
    fn every_kernel_matches_the_reference() {
        let lens = [1, 5, 16, 17, 70, 133];
        for (heads, kv_heads, dim) in [
            (14, 2, 64),
            (16, 2, 128),
            (9, 1, 48),
            (4, 4, 64),
            (7, 1, 80),
            (6, 2, 96),
            (8, 1, 16),
            (4, 2, 40),
        ] {
            let case = Case::new(heads, kv_heads, dim, &lens);
            for opts in
                [options(dim, None, None), options(dim, Some(24), None), options(dim, None, Some(2.0))]
            {
                let want = case.reference(&opts);
                for (name, kernel) in kernels(dim) {
                    let got = case.run(&opts, |u, o| kernel(u, opts.soft_cap, o));
                    assert_near(&got, &want, &format!("{name} {heads}/{kv_heads}x{dim} {opts:?}"));
                }
            }
        }
    }

    /// `xs / scale` in `C`, and what a reader gets back (`C` times the scale) in f32.
    fn quantized<C: Element>(xs: &[f32], scale: f32) -> (Vec<C>, Vec<f32>) {
        let q: Vec<C> = xs.iter().map(|&x| C::from_f32(x / scale)).collect();
        let back = q.iter().map(|c| c.to_f32() * scale).collect();
        (q, back)
    }

    /// A quantized cache through each kernel this CPU runs, against the f64 reference over the
    /// values the cache holds (the format's rounding is the cache's, not the kernel's, error).
    fn check_quantized_cache<C: SimdElement>(case: Case, scales: KvScales) {
        let (keys, key_values) = quantized::<C>(&case.keys, scales.key);
        let (values, value_values) = quantized::<C>(&case.values, scales.value);
        let inputs = DecodeInputs {
            query: &case.query,
            key_cache: &keys,
            value_cache: &values,
            block_tables: &case.tables,
            seq_lens: &case.lens,
            scales,
        };
        let (shape, dim) = (case.shape, case.shape.head_dim);
        for opts in [options(dim, None, None), options(dim, Some(24), Some(2.0))] {
            let want = Case { keys: key_values.clone(), values: value_values.clone(), ..case.clone() }
                .reference(&opts);
            let row_len = shape.num_heads * dim;
            let run = |kernel: &dyn Fn(&Unit<'_, C>, &mut [f32])| {
                let mut out = vec![0.0f32; want.len()];
                for (row, out) in out.chunks_exact_mut(row_len).enumerate() {
                    kernel(&Unit::new(&inputs, &shape, &opts, row), out);
                }
                out
            };
            assert_near(&run(&|u, o| attend_portable(u, opts.soft_cap, o)), &want, "portable");
            #[cfg(target_arch = "x86_64")]
            {
                if crate::simd::has_avx2_fma() && avx2::supports(dim) {
                    // SAFETY: checked just above; the units come from consistent inputs.
                    assert_near(&run(&|u, o| unsafe { avx2::attend(u, opts.soft_cap, o) }), &want, "avx2");
                }
                if avx512::supports(dim) {
                    // SAFETY: as above.
                    assert_near(
                        &run(&|u, o| unsafe { avx512::attend(u, opts.soft_cap, o) }),
                        &want,
                        "avx512",
                    );
                }
            }
            let mut out = vec![0.0f32; want.len()];
            paged_decode(inputs, shape, opts, &mut out, 2).unwrap();
            assert_near(&out, &want, "paged_decode");
        }
    }

    #[test]
    fn fp8_caches_with_scales_match_the_reference_through_every_kernel() {
        use crate::element::{Fp8E4m3, Fp8E5m2};
        let scales = KvScales { key: 0.05, value: 0.02 };
        for (heads, kv_heads, dim) in [(14, 2, 64), (4, 2, 40), (8, 1, 16)] {
            check_quantized_cache::<Fp8E4m3>(Case::new(heads, kv_heads, dim, &[1, 17, 70]), scales);
            check_quantized_cache::<Fp8E5m2>(Case::new(heads, kv_heads, dim, &[1, 17, 70]), scales);
        }
    }

    #[test]
    fn a_nonpositive_cache_scale_is_refused() {
        let case = Case::new(4, 2, 16, &[3]);
        let inputs = DecodeInputs { scales: KvScales { key: 1.0, value: 0.0 }, ..case.inputs() };
        let mut out = vec![0.0; case.query.len()];
        let err = paged_decode(inputs, case.shape, options(16, None, None), &mut out, 1).unwrap_err();
        assert!(matches!(err, KernelError::Value { name: "v_scale", .. }), "{err:?}");
    }

    #[test]
    fn fewer_requests_than_threads_share_out_their_kv_heads_as_one_thread_does() {
        // 1 request of 3 KV heads on 2 threads (a thread's share ends mid-request), 2 requests on
        // 3 and 4 threads, 1 request with one KV head; and one too short to split.
        for (heads, kv_heads, lens, threads) in [
            (9, 3, vec![150], 2),
            (14, 2, vec![200, 33], 3),
            (14, 2, vec![40, 90], 4),
            (4, 1, vec![100], 2),
            (9, 3, vec![20], 2),
        ] {
            let case = Case::new(heads, kv_heads, 64, &lens);
            let opts = options(64, None, None);
            let mut one = vec![0.0; case.query.len()];
            paged_decode(case.inputs(), case.shape, opts, &mut one, 1).unwrap();
            let mut split = vec![f32::NAN; case.query.len()];
            paged_decode(case.inputs(), case.shape, opts, &mut split, threads).unwrap();
            assert_eq!(split, one, "{heads}/{kv_heads} heads, lens {lens:?}, {threads} threads");
            assert_near(&split, &case.reference(&opts), "paged_decode");
        }
    }

    #[test]
    fn paged_decode_splits_rows_over_threads_as_one_thread_does() {
        let case = Case::new(14, 2, 64, &[3, 200, 45, 1, 90, 17, 64]);
        let opts = options(64, None, None);
        let mut out = vec![0.0; case.query.len()];
        paged_decode(case.inputs(), case.shape, opts, &mut out, 2).unwrap();
        assert_near(&out, &case.reference(&opts), "paged_decode");
    }
}
