//! Prefix-cache lookup of a 4096-token prompt (block size 16) whose blocks are all cached: the
//! lookup alone with the request's block hashes already computed, and hashing plus lookup for a
//! fresh request.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use ferrollm_core::kv_cache::KVCacheManager;
use ferrollm_core::request::Request;
use ferrollm_core::{CacheConfig, EngineRequest, SamplingOptions};

const PROMPT_LEN: usize = 4096;
const BLOCK_SIZE: usize = 16;

fn request(tokens: &[u32]) -> Request {
    let er = EngineRequest::new("bench", tokens.to_vec(), SamplingOptions::default());
    Request::new(er, 0, PROMPT_LEN + 16)
}

/// A manager whose cache holds every full block of `tokens`, all freed.
fn warm_manager(tokens: &[u32]) -> KVCacheManager {
    let cfg = CacheConfig {
        block_size: BLOCK_SIZE,
        num_blocks: 1024,
        enable_prefix_caching: true,
        sliding_window: None,
    };
    let mut m = KVCacheManager::new(&cfg);
    let mut req = request(tokens);
    m.allocate_slots(0, &mut req, tokens.len(), &[], 0).expect("cache holds the prompt");
    m.free(0);
    m
}

fn bench_prefix_lookup(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..PROMPT_LEN as u32).map(|t| t.wrapping_mul(2_654_435_761) % 50_000).collect();
    let mut m = warm_manager(&tokens);
    let mut g = c.benchmark_group("prefix_lookup");
    g.throughput(Throughput::Elements(PROMPT_LEN as u64));
    let mut hashed = request(&tokens);
    assert_eq!(m.get_computed_blocks(&mut hashed).1, PROMPT_LEN - BLOCK_SIZE);
    g.bench_function("lookup_4096_hashed", |b| b.iter(|| black_box(m.get_computed_blocks(&mut hashed))));
    g.bench_function("hash_and_lookup_4096", |b| {
        b.iter_batched(
            || request(&tokens),
            |mut req| {
                let hit = m.get_computed_blocks(&mut req);
                (req, hit)
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench_prefix_lookup);
criterion_main!(benches);
