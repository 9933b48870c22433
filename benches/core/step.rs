//! One engine step with 256 running decodes: `schedule()` (block allocation and the flat step
//! arrays) plus `update()` (append, stop checks), without detokenization.
//! Target: under 100 µs per step.
//!
//! Run: `cargo bench -p ferrollm-core --bench step`

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ferrollm_core::engine::EngineCore;
use ferrollm_core::{CacheConfig, EngineConfig, EngineRequest, SamplingOptions, SchedulerConfig};

const NUM_REQS: usize = 256;
const PROMPT_LEN: usize = 128;
const STEPS_PER_ENGINE: u64 = 64;

fn engine() -> EngineCore {
    let cfg = EngineConfig {
        cache: CacheConfig {
            block_size: 16,
            num_blocks: 4096,
            enable_prefix_caching: true,
            sliding_window: None,
        },
        scheduler: SchedulerConfig {
            max_num_seqs: NUM_REQS,
            max_num_batched_tokens: NUM_REQS * PROMPT_LEN,
            max_model_len: 4096,
            ..Default::default()
        },
        stream_outputs: false,
    };
    let mut core = EngineCore::new(cfg, None).expect("valid config");
    let sampling =
        SamplingOptions { max_tokens: Some(1024), ignore_eos: true, detokenize: false, ..Default::default() };
    let reqs = (0..NUM_REQS)
        .map(|i| {
            let prompt = (0..PROMPT_LEN as u32).map(|t| (t * 7 + i as u32 * 131) % 32000).collect();
            EngineRequest::new(format!("r{i}"), prompt, sampling.clone())
        })
        .collect();
    core.add_requests(reqs).expect("valid requests");
    // Prefill everything so the timed steps are pure decodes.
    let step = core.schedule();
    core.update(&vec![1; step.num_reqs()]).expect("update");
    core
}

fn decode_step(c: &mut Criterion) {
    let sampled = vec![42u32; NUM_REQS];
    c.bench_function("schedule+update, 256 running decodes", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let mut core = engine();
                let n = STEPS_PER_ENGINE.min(iters - done);
                let start = Instant::now();
                for _ in 0..n {
                    let step = core.schedule();
                    assert_eq!(step.num_reqs(), NUM_REQS);
                    core.update(&sampled).expect("update");
                }
                total += start.elapsed();
                done += n;
            }
            total
        })
    });
}

criterion_group!(benches, decode_step);
criterion_main!(benches);
