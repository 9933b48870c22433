//! Scheduler behaviour through the engine handle, with a deterministic runner.

mod common;

use common::*;
use ferrollm_core::engine::{EngineCore, ModelRunner};
use ferrollm_core::{EngineRequest, FinishReason, SamplingOptions, SchedulingPolicy, StopReason};

#[test]
fn decodes_and_prefill_chunks_share_one_token_budget() {
    let mut core = EngineCore::new(config(16, 64, 8, 32, 256), None).unwrap();
    core.add_request(request("a", prompt(1, 10), 4)).unwrap();
    let first = core.schedule();
    assert_eq!(first.total_num_scheduled_tokens, 10);
    core.update(&[5]).unwrap();
    core.add_request(request("b", prompt(2, 100), 4)).unwrap();
    let second = core.schedule();
    // one decode for `a`, then a 31-token chunk of `b`'s prompt
    assert_eq!(second.num_scheduled_tokens, vec![1, 31]);
    assert_eq!(second.needs_sample, vec![true, false]);
    assert_eq!(second.query_start_loc, vec![0, 1, 32]);
}

#[test]
fn chunked_prefill_gives_the_same_tokens_as_one_pass() {
    let p = prompt(3, 100);
    let mut core = EngineCore::new(config(16, 64, 4, 24, 256), None).unwrap();
    core.add_request(request("a", p.clone(), 8)).unwrap();
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    assert_eq!(outs[0].token_ids, reference_tokens(&p, 8));
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Length));
}

#[test]
fn unchunked_prefill_waits_for_room_in_the_budget() {
    let mut cfg = config(16, 64, 4, 64, 64);
    cfg.scheduler.enable_chunked_prefill = false;
    let mut core = EngineCore::new(cfg, None).unwrap();
    core.add_request(request("a", prompt(1, 40), 4)).unwrap();
    core.add_request(request("b", prompt(2, 40), 4)).unwrap();
    let step = core.schedule();
    assert_eq!(step.num_scheduled_tokens, vec![40]);
}

#[test]
fn shared_prefix_is_served_from_the_cache() {
    let mut core = EngineCore::new(config(16, 64, 4, 256, 256), None).unwrap();
    let shared = prompt(9, 48);
    let mut p1 = shared.clone();
    p1.extend(prompt(1, 12));
    let mut p2 = shared.clone();
    p2.extend(prompt(2, 12));
    core.add_request(request("a", p1, 2)).unwrap();
    core.schedule();
    core.update(&[1]).unwrap();
    core.add_request(request("b", p2, 2)).unwrap();
    let step = core.schedule();
    assert_eq!(step.num_computed_tokens, vec![60, 48]);
    let a = core.scheduler().index_of("a").unwrap();
    let b = core.scheduler().index_of("b").unwrap();
    let kv = core.scheduler().kv_cache();
    assert_eq!(&kv.block_ids(a)[..3], &kv.block_ids(b)[..3]);
    for &blk in &kv.block_ids(a)[..3] {
        assert_eq!(kv.pool().ref_cnt(blk), 2);
    }
    core.update(&[1, 1]).unwrap();
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    let b_out = outs.iter().find(|o| o.request_id == "b").unwrap();
    assert_eq!(b_out.num_cached_tokens, 48);
}

#[test]
fn preemption_resumes_with_the_same_tokens() {
    // 12 usable blocks of 4 tokens: three 10-token prompts growing to 30 tokens cannot all fit.
    let mut core = EngineCore::new(config(4, 13, 3, 64, 48), None).unwrap();
    let prompts: Vec<_> = (0..3).map(|i| prompt(i, 10)).collect();
    for (i, p) in prompts.iter().enumerate() {
        core.add_request(request(&format!("r{i}"), p.clone(), 20)).unwrap();
    }
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    assert!(core.scheduler().stats().num_preemptions > 0, "the cache was meant to run out");
    for (i, p) in prompts.iter().enumerate() {
        let o = outs.iter().find(|o| o.request_id == format!("r{i}")).unwrap();
        assert_eq!(o.token_ids, reference_tokens(p, 20), "request r{i}");
    }
}

#[test]
fn preemption_takes_the_latest_request_and_admits_nobody() {
    // 6 usable blocks of 4 tokens; `c` waits behind max_num_seqs = 2.
    let mut core = EngineCore::new(config(4, 7, 2, 64, 24), None).unwrap();
    core.add_request(request("a", prompt(1, 8), 30)).unwrap();
    core.add_request(request("b", prompt(2, 8), 30)).unwrap();
    core.add_request(request("c", prompt(3, 2), 4)).unwrap();
    let mut runner = EchoRunner::default();
    core.step(&mut runner).unwrap();
    let mut saw_preemption = false;
    for _ in 0..20 {
        let step = core.schedule();
        if !step.preempted_req_indices.is_empty() {
            let b = core.scheduler().index_of("b").unwrap() as i64;
            assert_eq!(step.preempted_req_indices, vec![b]);
            assert!(step.scheduled_new_reqs.is_empty(), "nobody is admitted in a preempting step");
            saw_preemption = true;
            break;
        }
        let sampled = runner_tokens(&step);
        core.update(&sampled).unwrap();
    }
    assert!(saw_preemption);
}

fn runner_tokens(step: &ferrollm_core::scheduler::SchedulerOutput) -> Vec<u32> {
    step.logits_indices
        .iter()
        .map(|&i| next_token(step.input_ids[i as usize], step.positions[i as usize]))
        .collect()
}

#[test]
fn max_num_seqs_caps_the_running_set() {
    let mut core = EngineCore::new(config(16, 64, 2, 512, 256), None).unwrap();
    for i in 0..5 {
        core.add_request(request(&format!("r{i}"), prompt(i, 5), 3)).unwrap();
    }
    assert_eq!(core.schedule().num_reqs(), 2);
    assert_eq!(core.scheduler().num_waiting(), 3);
}

#[test]
fn priority_policy_admits_lowest_value_first() {
    let mut cfg = config(16, 64, 1, 512, 256);
    cfg.scheduler.policy = SchedulingPolicy::Priority;
    let mut core = EngineCore::new(cfg, None).unwrap();
    for (id, prio) in [("low", 5), ("high", -1), ("mid", 0)] {
        core.add_request(EngineRequest { priority: prio, ..request(id, prompt(1, 4), 1) }).unwrap();
    }
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    let order: Vec<_> = outs.iter().map(|o| o.request_id.as_str()).collect();
    assert_eq!(order, vec!["high", "mid", "low"]);
}

#[test]
fn priority_policy_preempts_the_lowest_priority_running_request() {
    // 6 usable blocks of 4 tokens: two 8-token prompts growing to 22 tokens cannot both fit.
    let mut cfg = config(4, 7, 2, 64, 24);
    cfg.scheduler.policy = SchedulingPolicy::Priority;
    let mut core = EngineCore::new(cfg, None).unwrap();
    // `urgent` arrives last but has the smaller value: it is the one kept running.
    core.add_request(EngineRequest { priority: 1, ..request("background", prompt(1, 8), 14) }).unwrap();
    core.add_request(EngineRequest { priority: 0, ..request("urgent", prompt(2, 8), 14) }).unwrap();
    let mut runner = EchoRunner::default();
    let mut preempted = Vec::new();
    let mut outs = Vec::new();
    while core.has_unfinished_requests() {
        let step = core.schedule();
        preempted.extend(
            step.preempted_req_indices
                .iter()
                .map(|&i| core.scheduler().request(i as usize).unwrap().request_id.clone()),
        );
        let sampled = runner.execute_model(&step).unwrap();
        outs.extend(core.update(&sampled).unwrap());
    }
    assert!(!preempted.is_empty() && preempted.iter().all(|id| id == "background"), "{preempted:?}");
    assert_eq!(outs[0].request_id, "urgent");
    assert_eq!(outs[1].token_ids, reference_tokens(&prompt(1, 8), 14));
}

#[test]
fn long_prefill_threshold_caps_each_requests_chunk() {
    let mut cfg = config(16, 64, 4, 64, 256);
    cfg.scheduler.long_prefill_token_threshold = 12;
    let mut core = EngineCore::new(cfg, None).unwrap();
    core.add_request(request("a", prompt(1, 40), 4)).unwrap();
    core.add_request(request("b", prompt(2, 5), 4)).unwrap();
    assert_eq!(core.schedule().num_scheduled_tokens, vec![12, 5]);
}

#[test]
fn long_prefill_threshold_spares_a_lone_request() {
    let mut cfg = config(16, 64, 4, 64, 256);
    cfg.scheduler.long_prefill_token_threshold = 12;
    let mut core = EngineCore::new(cfg, None).unwrap();
    core.add_request(request("a", prompt(1, 40), 4)).unwrap();
    assert_eq!(core.schedule().num_scheduled_tokens, vec![40]);
}

#[test]
fn new_request_data_is_sent_once_then_only_diffs() {
    let mut core = EngineCore::new(config(4, 65, 2, 512, 256), None).unwrap();
    core.add_request(request("a", prompt(1, 6), 8)).unwrap();
    let s1 = core.schedule();
    assert_eq!(s1.scheduled_new_reqs.len(), 1);
    assert_eq!(s1.scheduled_new_reqs[0].prompt_token_ids, prompt(1, 6));
    assert_eq!(s1.scheduled_new_reqs[0].block_ids.len(), 2);
    core.update(&[3]).unwrap();
    let s2 = core.schedule();
    assert!(s2.scheduled_new_reqs.is_empty());
    assert_eq!(s2.scheduled_cached_reqs.len(), 1);
    assert!(s2.scheduled_cached_reqs[0].new_block_ids.is_empty(), "7 tokens still fit in 2 blocks");
    core.update(&[4]).unwrap();
    let s3 = core.schedule();
    assert!(s3.scheduled_cached_reqs[0].new_block_ids.is_empty(), "8 tokens fill 2 blocks");
    core.update(&[5]).unwrap();
    let s4 = core.schedule();
    assert_eq!(s4.scheduled_cached_reqs[0].new_block_ids.len(), 1, "token 9 needs a third block");
}

#[test]
fn abort_returns_one_final_output() {
    let mut core = EngineCore::new(config(16, 64, 4, 512, 256), None).unwrap();
    core.add_request(request("a", prompt(1, 5), 50)).unwrap();
    core.add_request(request("b", prompt(2, 5), 3)).unwrap();
    let mut runner = EchoRunner::default();
    core.step(&mut runner).unwrap();
    assert_eq!(core.abort_requests(&["a".into(), "zzz".into()]), 1);
    assert_eq!(core.abort_requests(&["a".into()]), 0);
    let outs = run_to_completion(&mut core, &mut runner);
    let ids: Vec<_> = outs.iter().map(|o| (o.request_id.as_str(), o.finish_reason)).collect();
    assert_eq!(ids, vec![("a", Some(FinishReason::Abort)), ("b", Some(FinishReason::Length))]);
    assert_eq!(outs[0].token_ids.len(), 1);
}

#[test]
fn length_cap_respects_max_model_len() {
    let mut core = EngineCore::new(config(16, 64, 4, 512, 32), None).unwrap();
    core.add_request(request("a", prompt(1, 30), 100)).unwrap();
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    assert_eq!(outs[0].token_ids.len(), 2);
    assert_eq!(outs[0].finish_reason, Some(FinishReason::Length));
}

#[test]
fn stop_token_id_ends_request_with_its_reason() {
    let p = prompt(4, 6);
    let expected = reference_tokens(&p, 10);
    let stop = expected[3];
    let mut core = EngineCore::new(config(16, 64, 4, 512, 256), None).unwrap();
    let sampling = SamplingOptions { max_tokens: Some(10), stop_token_ids: vec![stop], ..Default::default() };
    core.add_request(EngineRequest::new("a", p.clone(), sampling)).unwrap();
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    let first_stop = expected.iter().position(|&t| t == stop).unwrap();
    assert_eq!(outs[0].token_ids, expected[..=first_stop].to_vec());
    assert_eq!(outs[0].stop_reason, Some(StopReason::TokenId(stop)));
}

#[test]
fn min_tokens_defers_stop_tokens() {
    let p = prompt(4, 6);
    let expected = reference_tokens(&p, 10);
    let stop = expected[0];
    let mut core = EngineCore::new(config(16, 64, 4, 512, 256), None).unwrap();
    let sampling = SamplingOptions {
        max_tokens: Some(10),
        min_tokens: 3,
        stop_token_ids: vec![stop],
        ..Default::default()
    };
    core.add_request(EngineRequest::new("a", p, sampling)).unwrap();
    let outs = run_to_completion(&mut core, &mut EchoRunner::default());
    assert!(outs[0].token_ids.len() >= 3);
}

#[test]
fn invalid_batch_queues_nothing() {
    let mut core = EngineCore::new(config(16, 64, 4, 512, 64), None).unwrap();
    let bad = request("b", prompt(1, 64), 4);
    let err = core.add_requests(vec![request("a", prompt(1, 4), 4), bad]).unwrap_err();
    assert!(err.to_string().contains("max_model_len"), "{err}");
    assert!(!core.has_unfinished_requests());
    let dup = core.add_requests(vec![request("a", prompt(1, 4), 4), request("a", prompt(1, 4), 4)]);
    assert!(dup.unwrap_err().to_string().contains("`a`"));
}

#[test]
fn update_rejects_a_token_count_that_does_not_match_the_step() {
    let mut core = EngineCore::new(config(16, 64, 4, 512, 64), None).unwrap();
    core.add_request(request("a", prompt(1, 4), 4)).unwrap();
    core.schedule();
    let err = core.update(&[1, 2]).unwrap_err().to_string();
    assert!(err.contains("one token per scheduled request (1)"), "{err}");
    core.update(&[1]).unwrap();
}

#[test]
fn sliding_window_frees_blocks_outside_the_window() {
    // 10 usable blocks of 4 tokens = 40 tokens, but each request grows to 8 + 60 = 68 tokens:
    // only freeing blocks behind the 8-token window lets both finish without preemption.
    let mut cfg = config(4, 11, 2, 16, 128);
    cfg.cache.sliding_window = Some(8);
    let mut core = EngineCore::new(cfg, None).unwrap();
    let prompts: Vec<_> = (0..2).map(|i| prompt(i, 8)).collect();
    for (i, p) in prompts.iter().enumerate() {
        core.add_request(request(&format!("r{i}"), p.clone(), 60)).unwrap();
    }
    let mut runner = EchoRunner::default();
    let mut outs = Vec::new();
    while core.has_unfinished_requests() {
        outs.extend(core.step(&mut runner).unwrap());
        core.scheduler().kv_cache().check_invariants().unwrap();
        for &idx in core.scheduler().running() {
            let live = core.scheduler().kv_cache().block_ids(idx).iter().filter(|&&b| b != 0).count();
            assert!(live <= 4, "a request holds only the window's blocks and the one being filled");
        }
    }
    assert_eq!(core.scheduler().stats().num_preemptions, 0);
    for (i, p) in prompts.iter().enumerate() {
        let o = outs.iter().find(|o| o.request_id == format!("r{i}")).unwrap();
        assert_eq!(o.token_ids, reference_tokens(p, 60));
    }
    assert_eq!(core.scheduler().kv_cache().num_free_blocks(), 10);
}

fn with_image(id: &str, p: Vec<u32>, offset: usize, length: usize) -> EngineRequest {
    let feature =
        ferrollm_core::kv_cache::MultiModalFeature { identifier: format!("{id}-img"), offset, length };
    EngineRequest { mm_features: vec![feature], ..request(id, p, 2) }
}

#[test]
fn encoder_budget_cuts_a_chunk_before_an_image_that_does_not_fit() {
    let mut cfg = config(16, 64, 4, 256, 256);
    cfg.scheduler.max_num_encoder_input_tokens = 30;
    let mut core = EngineCore::new(cfg, None).unwrap();
    core.add_request(with_image("a", prompt(1, 40), 5, 20)).unwrap();
    core.add_request(with_image("b", prompt(2, 40), 10, 20)).unwrap();
    let first = core.schedule();
    // `a`'s image takes 20 of the 30; `b` runs its text up to its image only.
    assert_eq!(first.num_scheduled_tokens, vec![40, 10]);
    core.update(&[0, 0]).unwrap();
    let second = core.schedule();
    // `a` decodes; `b`'s image now fits the fresh budget and the rest of its prompt runs.
    assert_eq!(second.num_scheduled_tokens, vec![1, 30]);
}

#[test]
fn an_image_larger_than_the_encoder_budget_is_refused() {
    let mut cfg = config(16, 64, 4, 256, 256);
    cfg.scheduler.max_num_encoder_input_tokens = 16;
    let mut core = EngineCore::new(cfg, None).unwrap();
    let err = core.add_request(with_image("a", prompt(1, 40), 5, 20)).unwrap_err();
    assert!(err.to_string().contains("max_num_encoder_input_tokens (16)"), "{err}");
    let err = core.add_request(with_image("b", prompt(1, 10), 5, 20)).unwrap_err();
    assert!(err.to_string().contains("inside the prompt"), "{err}");
}
