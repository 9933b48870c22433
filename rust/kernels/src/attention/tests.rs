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
                let keys: Vec<&[f32]> = visible.iter().map(|&t| &self.keys[slot(t) + kv..][..dim]).collect();
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
            kernel(&whole_context(&inputs, &self.shape, options, row), out);
        }
        out
    }
}

/// Request `row`'s unit over every position it sees.
fn whole_context<'a, C: SimdElement>(
    inputs: &DecodeInputs<'a, f32, C>,
    shape: &DecodeShape,
    options: &DecodeOptions,
    row: usize,
) -> Unit<'a, C> {
    let n = visible(inputs.seq_lens[row] as usize, options).len();
    Unit::new(inputs, shape, options, row, 0..n)
}

fn options(head_dim: usize, sliding_window: Option<usize>, soft_cap: Option<f32>) -> DecodeOptions {
    DecodeOptions { scale: (head_dim as f32).powf(-0.5), sliding_window, soft_cap }
}

/// A kernel as the tests call it: outputs written, log masses returned.
type Kernel = Box<dyn Fn(&Unit<'_, f32>, Option<f32>, &mut [f32]) -> Vec<f32>>;

/// Every kernel this CPU runs, by name; each takes the head sizes `supports` admits.
fn kernels(head_dim: usize) -> Vec<(&'static str, Kernel)> {
    let mut all: Vec<(&'static str, Kernel)> = vec![("portable", Box::new(attend_portable))];
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
    for (heads, kv_heads, dim) in
        [(14, 2, 64), (16, 2, 128), (9, 1, 48), (4, 4, 64), (7, 1, 80), (6, 2, 96), (8, 1, 16), (4, 2, 40)]
    {
        let case = Case::new(heads, kv_heads, dim, &lens);
        for opts in [options(dim, None, None), options(dim, Some(24), None), options(dim, None, Some(2.0))] {
            let want = case.reference(&opts);
            for (name, kernel) in kernels(dim) {
                let got = case.run(&opts, |u, o| {
                    kernel(u, opts.soft_cap, o);
                });
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
        let want =
            Case { keys: key_values.clone(), values: value_values.clone(), ..case.clone() }.reference(&opts);
        let row_len = shape.num_heads * dim;
        let run = |kernel: &dyn Fn(&Unit<'_, C>, &mut [f32])| {
            let mut out = vec![0.0f32; want.len()];
            for (row, out) in out.chunks_exact_mut(row_len).enumerate() {
                kernel(&whole_context(&inputs, &shape, &opts, row), out);
            }
            out
        };
        assert_near(
            &run(&|u, o| {
                attend_portable(u, opts.soft_cap, o);
            }),
            &want,
            "portable",
        );
        #[cfg(target_arch = "x86_64")]
        {
            if crate::simd::has_avx2_fma() && avx2::supports(dim) {
                // SAFETY: checked just above; the units come from consistent inputs.
                let got = run(&|u, o| {
                    unsafe { avx2::attend(u, opts.soft_cap, o) };
                });
                assert_near(&got, &want, "avx2");
            }
            if avx512::supports(dim) {
                // SAFETY: as above.
                let got = run(&|u, o| {
                    unsafe { avx512::attend(u, opts.soft_cap, o) };
                });
                assert_near(&got, &want, "avx512");
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
        // One request on two threads: its context split in two, the scales in both pieces.
        check_quantized_cache::<Fp8E4m3>(Case::new(heads, kv_heads, dim, &[70]), scales);
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
fn fewer_requests_than_threads_split_their_contexts_and_merge_them_like_the_reference() {
    // 1 request of 3 KV heads on 2 threads, 2 requests on 3 and 4 threads (one long, one short:
    // the long one takes more pieces), 1 request with one KV head, one too short to split, and
    // one just long enough for two pieces; with a window and a soft cap.
    for (heads, kv_heads, lens, threads) in [
        (9, 3, vec![150], 2),
        (14, 2, vec![200, 33], 3),
        (14, 2, vec![40, 90], 4),
        (4, 1, vec![100], 2),
        (9, 3, vec![20], 2),
        (9, 3, vec![32], 2),
    ] {
        let case = Case::new(heads, kv_heads, 64, &lens);
        for opts in [options(64, None, None), options(64, Some(24), None), options(64, None, Some(2.0))] {
            let label = format!("{heads}/{kv_heads} heads, lens {lens:?}, {threads} threads, {opts:?}");
            let mut split = vec![f32::NAN; case.query.len()];
            paged_decode(case.inputs(), case.shape, opts, &mut split, threads).unwrap();
            assert_near(&split, &case.reference(&opts), &label);
        }
    }
}

#[test]
fn merged_pieces_weigh_each_by_its_share_of_the_softmax_mass() {
    // Two pieces of one head of dim 2: masses e^1 and e^3 (log masses 1 and 3).
    let pieces = [1.0, 2.0, 1.0, /* piece 2 */ 5.0, 6.0, 3.0];
    let mut out = [0.0f32; 2];
    merge_pieces(&pieces, 1, 2, &mut out);
    let w = 1.0 / (1.0 + 2f32.exp());
    assert_near(&out, &[w * 1.0 + (1.0 - w) * 5.0, w * 2.0 + (1.0 - w) * 6.0], "two pieces");
    // One piece is copied as it is.
    merge_pieces(&pieces[..3], 1, 2, &mut out);
    assert_eq!(out, [1.0, 2.0]);
}

#[test]
fn paged_decode_splits_rows_over_threads_as_one_thread_does() {
    let case = Case::new(14, 2, 64, &[3, 200, 45, 1, 90, 17, 64]);
    let opts = options(64, None, None);
    let mut out = vec![0.0; case.query.len()];
    paged_decode(case.inputs(), case.shape, opts, &mut out, 2).unwrap();
    assert_near(&out, &case.reference(&opts), "paged_decode");
}
