//! Block pool hot paths: allocating and freeing 256 blocks, allocation that evicts cached blocks,
//! and the prefix-hit path (touching free cached blocks, then freeing them again).

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use ferrollm_core::kv_cache::{BlockHash, BlockPool};

const NUM_BLOCKS: usize = 1025;
const BATCH: usize = 256;

/// A pool whose first `BATCH` blocks were cached and freed, last block first.
fn pool_with_cached_free_blocks() -> (BlockPool, Vec<u32>) {
    let mut pool = BlockPool::new(NUM_BLOCKS, true);
    let ids = pool.get_new_blocks(BATCH).expect("pool holds BATCH blocks");
    let hashes: Vec<BlockHash> = (0..BATCH as u128).map(BlockHash).collect();
    pool.cache_full_blocks(&ids, &hashes);
    pool.free_blocks(ids.iter().rev().copied());
    (pool, ids)
}

fn bench_block_pool(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_pool");
    g.throughput(Throughput::Elements(BATCH as u64));
    g.bench_function("allocate_free_256", |b| {
        b.iter_batched(
            || BlockPool::new(NUM_BLOCKS, true),
            |mut pool| {
                let ids = pool.get_new_blocks(black_box(BATCH)).expect("enough free blocks");
                pool.free_blocks(ids.into_iter().rev());
                pool
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("allocate_256_evicting_cached", |b| {
        b.iter_batched(
            || pool_with_cached_free_blocks().0,
            |mut pool| {
                let ids = pool.get_new_blocks(black_box(BATCH)).expect("enough free blocks");
                (pool, ids)
            },
            BatchSize::SmallInput,
        )
    });
    g.bench_function("touch_free_256_cached", |b| {
        let (mut pool, ids) = pool_with_cached_free_blocks();
        b.iter(|| {
            pool.touch(black_box(&ids));
            pool.free_blocks(ids.iter().rev().copied());
        })
    });
    g.finish();
}

criterion_group!(benches, bench_block_pool);
criterion_main!(benches);
