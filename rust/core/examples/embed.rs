//! Embedding ferrollm's engine core in a Rust program.
//!
//! A tiny deterministic "model" stands in for the model runner: it maps each request's last
//! token and position to the next token. The example drives the engine twice: synchronously with
//! `EngineCore::step`, and through `AsyncEngine`, where several tokio tasks submit requests while
//! the step loop runs and read their tokens back as they stream.
//!
//! Run: `cargo run --release -p ferrollm-core --example embed`

use std::time::Instant;

use ferrollm_core::engine::{AsyncEngine, EngineCore, ModelRunner};
use ferrollm_core::scheduler::SchedulerOutput;
use ferrollm_core::{CoreResult, EngineConfig, EngineRequest, SamplingOptions, TokenId};

/// A stand-in model: the next token depends only on the last token and its position.
struct TinyRunner;

impl ModelRunner for TinyRunner {
    fn execute_model(&mut self, batch: &SchedulerOutput) -> CoreResult<Vec<TokenId>> {
        let next = |i: usize| ((batch.input_ids[i] * 7 + batch.positions[i] * 13 + 1) % 1000) as TokenId;
        Ok(batch.logits_indices.iter().map(|&i| next(i as usize)).collect())
    }
}

fn request(i: usize, max_tokens: usize) -> EngineRequest {
    let prompt = (0..16 + i as u32 * 8).map(|t| (t * 31 + i as u32) % 1000).collect();
    let sampling = SamplingOptions { max_tokens: Some(max_tokens), ..Default::default() };
    EngineRequest::new(format!("req-{i}"), prompt, sampling)
}

fn run_sync() -> CoreResult<()> {
    let mut core = EngineCore::new(EngineConfig::default(), None)?;
    for i in 0..4 {
        core.add_request(request(i, 8))?;
    }
    let (mut steps, start) = (0, Instant::now());
    while core.has_unfinished_requests() {
        for out in core.step(&mut TinyRunner)? {
            let reason = out.finish_reason.map_or("-", |r| r.as_str());
            println!("sync  {} -> {:?} ({reason})", out.request_id, out.token_ids);
        }
        steps += 1;
    }
    println!("sync: {steps} steps in {:?}", start.elapsed());
    Ok(())
}

async fn run_async() -> CoreResult<()> {
    let cfg = EngineConfig { stream_outputs: true, ..Default::default() };
    let engine = std::sync::Arc::new(AsyncEngine::start(EngineCore::new(cfg, None)?, TinyRunner));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let mut stream = engine.submit(request(i, 6)).await?;
            let mut tokens = Vec::new();
            while let Some(out) = stream.next().await {
                let out = out?;
                tokens.extend(out.token_ids);
                if out.finished {
                    println!(
                        "async req-{i} streamed {tokens:?} ({})",
                        out.finish_reason.map_or("-", |r| r.as_str())
                    );
                }
            }
            CoreResult::Ok(())
        }));
    }
    for t in tasks {
        t.await.expect("task panicked")?;
    }
    match std::sync::Arc::try_unwrap(engine) {
        Ok(engine) => engine.shutdown().await,
        Err(_) => Ok(()),
    }
}

fn main() -> CoreResult<()> {
    run_sync()?;
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    rt.block_on(run_async())
}
