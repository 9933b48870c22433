//! Property tests over random sequences of add / step / abort / cache reset: the block manager
//! never leaks or double-owns a block, every step stays within its limits, preemption never
//! changes a request's tokens, and every request added comes back exactly once; under random
//! scheduling knobs (policy and priorities, chunked prefill on or off, a long-prefill cap), with
//! the priority policy admitting no request ahead of a waiting one with a smaller key.

mod common;

use std::collections::HashMap;

use common::*;
use ferrollm_core::engine::{EngineCore, ModelRunner};
use ferrollm_core::{EngineRequest, FinishReason, SchedulingPolicy, TokenId};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Add { prefix: u32, extra: usize, max_tokens: usize, priority: i32 },
    Step,
    Abort(usize),
    ResetCache,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..3, 1usize..40, 1usize..30, -2i32..3)
            .prop_map(|(prefix, extra, max_tokens, priority)| Op::Add { prefix, extra, max_tokens, priority }),
        6 => Just(Op::Step),
        1 => (0usize..64).prop_map(Op::Abort),
        1 => Just(Op::ResetCache),
    ]
}

const BUDGET: usize = 32;
const MAX_SEQS: usize = 4;
const NUM_BLOCKS: usize = 24;
const MAX_MODEL_LEN: usize = 80;

/// The scheduling options a workload runs under.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    sliding_window: Option<usize>,
    policy: SchedulingPolicy,
    chunked: bool,
    long_prefill: usize,
}

fn knobs() -> impl Strategy<Value = Knobs> {
    let window = prop_oneof![Just(None), (1usize..12).prop_map(Some)];
    let policy = prop_oneof![Just(SchedulingPolicy::Fcfs), Just(SchedulingPolicy::Priority)];
    let long_prefill = prop_oneof![Just(0usize), 1usize..20];
    (window, policy, any::<bool>(), long_prefill).prop_map(
        |(sliding_window, policy, chunked, long_prefill)| Knobs {
            sliding_window,
            policy,
            chunked,
            long_prefill,
        },
    )
}

struct Harness {
    knobs: Knobs,
    budget: usize,
    core: EngineCore,
    runner: EchoRunner,
    prompts: HashMap<String, (Vec<TokenId>, usize)>,
    added: Vec<String>,
    finished: HashMap<String, usize>,
    outputs: Vec<ferrollm_core::engine::RequestOutput>,
}

impl Harness {
    fn new(knobs: Knobs) -> Self {
        // Unchunked prefill needs a budget that holds a whole max_model_len prompt.
        let budget = if knobs.chunked { BUDGET } else { MAX_MODEL_LEN };
        let mut cfg = config(4, NUM_BLOCKS, MAX_SEQS, budget, MAX_MODEL_LEN);
        cfg.cache.sliding_window = knobs.sliding_window;
        cfg.scheduler.policy = knobs.policy;
        cfg.scheduler.enable_chunked_prefill = knobs.chunked;
        cfg.scheduler.long_prefill_token_threshold = knobs.long_prefill;
        Self {
            knobs,
            budget,
            core: EngineCore::new(cfg, None).unwrap(),
            runner: EchoRunner::default(),
            prompts: HashMap::new(),
            added: Vec::new(),
            finished: HashMap::new(),
            outputs: Vec::new(),
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Add { prefix, extra, max_tokens, priority } => {
                let id = format!("r{}", self.added.len());
                let mut p = prompt(100 + prefix, 16);
                p.extend(prompt(self.added.len() as u32, extra));
                self.core
                    .add_request(EngineRequest { priority, ..request(&id, p.clone(), max_tokens) })
                    .unwrap();
                self.prompts.insert(id.clone(), (p, max_tokens));
                self.added.push(id);
            }
            Op::Step => self.step()?,
            Op::Abort(i) if !self.added.is_empty() => {
                let id = self.added[i % self.added.len()].clone();
                self.core.abort_requests(&[id]);
            }
            Op::Abort(_) => {}
            Op::ResetCache => {
                self.core.reset_prefix_cache();
            }
        }
        self.check()
    }

    fn step(&mut self) -> Result<(), TestCaseError> {
        let live = self.core.scheduler().num_running() + self.core.scheduler().num_waiting();
        let batch = self.core.schedule();
        prop_assert!(batch.total_num_scheduled_tokens <= self.budget);
        prop_assert!(self.core.scheduler().num_running() <= MAX_SEQS);
        if self.knobs.long_prefill > 0 && live > 1 {
            prop_assert!(batch.num_scheduled_tokens.iter().all(|&n| n as usize <= self.knobs.long_prefill));
        }
        if self.knobs.policy == SchedulingPolicy::Priority {
            self.check_priority_admission(&batch)?;
        }
        let sampled = if batch.is_empty() { vec![] } else { self.runner.execute_model(&batch).unwrap() };
        for out in self.core.update(&sampled).unwrap() {
            *self.finished.entry(out.request_id.clone()).or_default() += 1;
            self.outputs.push(out);
        }
        Ok(())
    }

    /// Every request admitted this step has a (priority, arrival) key no larger than any request
    /// left waiting.
    fn check_priority_admission(
        &self,
        batch: &ferrollm_core::scheduler::SchedulerOutput,
    ) -> Result<(), TestCaseError> {
        let s = self.core.scheduler();
        let key = |i| s.request(i).map(|r| (r.priority, r.arrival)).unwrap();
        // Admitted this step: seen for the first time, or back from preemption.
        let new = batch.scheduled_new_reqs.iter().map(|n| n.req_index);
        let resumed =
            batch.scheduled_cached_reqs.iter().filter(|c| c.resumed_from_preemption).map(|c| c.req_index);
        let admitted = new.chain(resumed).map(key).max();
        if let (Some(admitted), Some(waiting)) = (admitted, s.waiting().map(key).min()) {
            prop_assert!(admitted <= waiting, "admitted {:?} ahead of waiting {:?}", admitted, waiting);
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        let kv = self.core.scheduler().kv_cache();
        kv.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert!(self.finished.values().all(|&n| n == 1), "a request came back twice");
        Ok(())
    }

    fn drain(&mut self) -> Result<(), TestCaseError> {
        let mut guard = 0;
        while self.core.has_unfinished_requests() {
            self.step()?;
            self.check()?;
            guard += 1;
            prop_assert!(guard < 10_000, "engine stalled");
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_every_invariant(
        ops in prop::collection::vec(op(), 1..120),
        knobs in knobs(),
    ) {
        let mut h = Harness::new(knobs);
        for op in &ops {
            h.apply(op)?;
        }
        h.drain()?;
        prop_assert_eq!(h.finished.len(), h.added.len(), "every request finishes");
        prop_assert_eq!(h.core.scheduler().kv_cache().num_free_blocks(), NUM_BLOCKS - 1, "no block leaked");
        for out in &h.outputs {
            let (p, max_tokens) = &h.prompts[&out.request_id];
            let expected = reference_tokens(p, (*max_tokens).min(MAX_MODEL_LEN - p.len()));
            if out.finish_reason == Some(FinishReason::Abort) {
                prop_assert_eq!(&out.token_ids[..], &expected[..out.token_ids.len()]);
            } else {
                prop_assert_eq!(&out.token_ids, &expected);
            }
        }
    }
}
