//! Shared helpers for the core's cross-module tests: a deterministic runner and config builders.
#![allow(dead_code)]

use ferrollm_core::engine::{EngineCore, ModelRunner, RequestOutput};
use ferrollm_core::scheduler::SchedulerOutput;
use ferrollm_core::{
    CacheConfig, CoreResult, EngineConfig, EngineRequest, SamplingOptions, SchedulerConfig, TokenId,
};

pub const VOCAB: i64 = 1000;

/// Samples a token that depends only on the last scheduled token and its position, so the same
/// request yields the same tokens however it is batched, chunked or preempted.
#[derive(Default)]
pub struct EchoRunner {
    pub steps: Vec<SchedulerOutput>,
    pub keep_steps: bool,
}

pub fn next_token(last: i64, pos: i64) -> TokenId {
    ((last * 7 + pos * 13 + 1) % VOCAB) as TokenId
}

impl ModelRunner for EchoRunner {
    fn execute_model(&mut self, batch: &SchedulerOutput) -> CoreResult<Vec<TokenId>> {
        let out = batch
            .logits_indices
            .iter()
            .map(|&i| next_token(batch.input_ids[i as usize], batch.positions[i as usize]))
            .collect();
        if self.keep_steps {
            self.steps.push(batch.clone());
        }
        Ok(out)
    }
}

pub fn config(
    block_size: usize,
    num_blocks: usize,
    max_num_seqs: usize,
    budget: usize,
    max_model_len: usize,
) -> EngineConfig {
    EngineConfig {
        cache: CacheConfig { block_size, num_blocks, enable_prefix_caching: true, sliding_window: None },
        scheduler: SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens: budget,
            max_model_len,
            ..Default::default()
        },
        stream_outputs: false,
    }
}

pub fn greedy(max_tokens: usize) -> SamplingOptions {
    SamplingOptions { max_tokens: Some(max_tokens), temperature: 0.0, ..Default::default() }
}

pub fn request(id: &str, prompt: Vec<TokenId>, max_tokens: usize) -> EngineRequest {
    EngineRequest::new(id, prompt, greedy(max_tokens))
}

/// Runs the engine until every request has its final output.
pub fn run_to_completion(core: &mut EngineCore, runner: &mut EchoRunner) -> Vec<RequestOutput> {
    let mut outs = Vec::new();
    let mut guard = 0;
    while core.has_unfinished_requests() {
        outs.extend(core.step(runner).expect("step"));
        guard += 1;
        assert!(guard < 100_000, "engine did not finish");
    }
    outs
}

/// The tokens a request yields when run alone: the reference for batching-invariance checks.
pub fn reference_tokens(prompt: &[TokenId], n: usize) -> Vec<TokenId> {
    let mut all: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
    let mut out = Vec::new();
    for _ in 0..n {
        let pos = all.len() as i64 - 1;
        let t = next_token(*all.last().unwrap(), pos);
        out.push(t);
        all.push(t as i64);
    }
    out
}

pub fn prompt(seed: u32, len: usize) -> Vec<TokenId> {
    (0..len as u32).map(|i| (seed * 31 + i * 17) % VOCAB as u32).collect()
}
