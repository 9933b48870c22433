//! The async face: concurrent submitters, per-request streams, aborts and runner failures.

mod common;

use std::sync::Arc;

use common::*;
use ferrollm_core::engine::{AsyncEngine, EngineCore, ModelRunner};
use ferrollm_core::scheduler::SchedulerOutput;
use ferrollm_core::{CoreError, CoreResult, FinishReason, TokenId};

fn streaming_core() -> EngineCore {
    let mut cfg = config(16, 256, 8, 512, 512);
    cfg.stream_outputs = true;
    EngineCore::new(cfg, None).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_tasks_each_stream_their_own_tokens() {
    let engine = Arc::new(AsyncEngine::start(streaming_core(), EchoRunner::default()));
    let mut tasks = Vec::new();
    for i in 0..16u32 {
        let engine = engine.clone();
        tasks.push(tokio::spawn(async move {
            let p = prompt(i, 5 + i as usize);
            let mut stream = engine.submit(request(&format!("r{i}"), p.clone(), 12)).await.unwrap();
            let (mut tokens, mut chunks) = (Vec::new(), 0);
            while let Some(out) = stream.next().await {
                let out = out.unwrap();
                chunks += 1;
                tokens.extend(out.token_ids);
                if out.finished {
                    assert_eq!(out.finish_reason, Some(FinishReason::Length));
                    break;
                }
            }
            assert_eq!(tokens, reference_tokens(&p, 12));
            assert!(chunks > 1, "tokens arrive as they are produced");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_request_is_refused_at_submit() {
    let engine = AsyncEngine::start(streaming_core(), EchoRunner::default());
    let err = engine.submit(request("bad", vec![], 4)).await.err().unwrap();
    assert!(err.to_string().contains("prompt"), "{err}");
    engine.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_ends_the_stream_with_reason_abort() {
    let engine = AsyncEngine::start(streaming_core(), EchoRunner::default());
    let mut stream = engine.submit(request("long", prompt(1, 4), 400)).await.unwrap();
    let first = stream.next().await.unwrap().unwrap();
    assert!(!first.finished);
    engine.abort("long");
    let mut last = first;
    while let Some(out) = stream.next().await {
        last = out.unwrap();
    }
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    engine.shutdown().await.unwrap();
}

struct FailingRunner;

impl ModelRunner for FailingRunner {
    fn execute_model(&mut self, _: &SchedulerOutput) -> CoreResult<Vec<TokenId>> {
        Err(CoreError::Runner("device lost".into()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runner_failure_reaches_every_stream() {
    let engine = AsyncEngine::start(streaming_core(), FailingRunner);
    let mut a = engine.submit(request("a", prompt(1, 4), 4)).await.unwrap();
    let err = a.next().await.unwrap().unwrap_err();
    assert_eq!(err, CoreError::Runner("device lost".into()));
    assert!(engine.shutdown().await.is_err());
}
