//! The scheduler: continuous batching over one token budget per step, chunked prefill,
//! prefix-cache-aware admission and preemption by recompute, with vLLM v1's semantics.
//!
//! It owns every live [`Request`] by value in a slab indexed by [`ReqIdx`]; the running list and
//! the waiting queue hold indices only. Invariants: a request is in exactly one of `running`,
//! `waiting` or neither (finished, awaiting release); `running.len() <= max_num_seqs`; a running
//! request owns KV blocks for every token it has computed; every token of a request stays within
//! `max_model_len`. Costs: `schedule` is O(scheduled requests + their block tables), `update` is
//! O(scheduled requests); string ids are hashed only in `add_request` and `abort`.

mod build;
mod encoder_budget;
mod output;
mod queue;
mod schedule;
mod update;

use std::collections::HashMap;

pub use output::{CachedRequestData, NewRequestData, SamplingArrays, SchedulerOutput};
pub use queue::RequestQueue;
pub use update::TokenEvent;

use crate::config::{CacheConfig, SchedulerConfig, SchedulingPolicy};
use crate::error::{CoreError, CoreResult};
use crate::kv_cache::KVCacheManager;
use crate::request::{EngineRequest, ReqIdx, Request, RequestStatus, RunnerView, StopReason, TokenId};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_preemptions: u64,
    pub num_free_blocks: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KVCacheManager,
    requests: Vec<Option<Request>>,
    free_slots: Vec<ReqIdx>,
    ids: HashMap<String, ReqIdx>,
    waiting: RequestQueue,
    running: Vec<ReqIdx>,
    next_arrival: u64,
    /// Finished since the last step, so the runner can drop their state.
    finished_since_step: Vec<ReqIdx>,
    /// The step whose sampled tokens `update` expects, and its request order.
    pending: Option<update::PendingStep>,
    eos_token_id: Option<TokenId>,
    next_step_id: u64,
    num_preemptions: u64,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, cache: &CacheConfig) -> Self {
        Self {
            waiting: RequestQueue::new(cfg.policy),
            kv: KVCacheManager::new(cache),
            cfg,
            requests: Vec::new(),
            free_slots: Vec::new(),
            ids: HashMap::new(),
            running: Vec::new(),
            next_arrival: 0,
            finished_since_step: Vec::new(),
            pending: None,
            eos_token_id: None,
            next_step_id: 0,
            num_preemptions: 0,
        }
    }

    /// The token that ends a request unless `ignore_eos` (the tokenizer's primary EOS).
    pub fn set_eos_token_id(&mut self, eos: Option<TokenId>) {
        self.eos_token_id = eos;
    }

    /// Checks a request against the engine's limits without queueing it.
    pub fn validate(&self, req: &EngineRequest) -> CoreResult<()> {
        if req.prompt_token_ids.is_empty() {
            // vLLM's wording in the bound, which scripts match on.
            let bound = "non-empty (The decoder prompt cannot be empty)";
            return Err(CoreError::invalid("prompt", bound, "an empty prompt"));
        }
        if req.prompt_token_ids.len() >= self.cfg.max_model_len {
            return Err(CoreError::PromptTooLong {
                request_id: req.request_id.clone(),
                num_tokens: req.prompt_token_ids.len(),
                max_model_len: self.cfg.max_model_len,
            });
        }
        if self.ids.contains_key(&req.request_id) {
            return Err(CoreError::DuplicateRequestId(req.request_id.clone()));
        }
        self.validate_mm_features(req)?;
        req.sampling.validate()
    }

    /// Multimodal items must be sorted, disjoint, inside the prompt and each (all of them,
    /// without chunked prefill) within the encoder budget, or the request could never run.
    fn validate_mm_features(&self, req: &EngineRequest) -> CoreResult<()> {
        let budget = self.cfg.max_num_encoder_input_tokens;
        let mut end = 0;
        for f in &req.mm_features {
            if f.offset < end || f.offset.checked_add(f.length).is_none_or(|e| e > req.prompt_token_ids.len())
            {
                let bound =
                    format!("sorted, disjoint and inside the prompt ({} tokens)", req.prompt_token_ids.len());
                return Err(CoreError::invalid("mm_features", bound, format!("{}..+{}", f.offset, f.length)));
            }
            end = f.offset + f.length;
        }
        let largest = req.mm_features.iter().map(|f| f.length).max().unwrap_or(0);
        let total: usize = req.mm_features.iter().map(|f| f.length).sum();
        let need = if self.cfg.enable_chunked_prefill { largest } else { total };
        if need > budget {
            let bound = format!("<= max_num_encoder_input_tokens ({budget}) placeholder tokens per step");
            return Err(CoreError::invalid("mm_features", bound, format!("{need} tokens")));
        }
        // An item taken whole must fit in one step.
        let step = self.cfg.max_num_batched_tokens;
        if self.cfg.disable_chunked_mm_input && largest > step {
            let bound = format!("<= max_num_batched_tokens ({step}) placeholder tokens per item");
            return Err(CoreError::invalid("mm_features", bound, format!("{largest} tokens")));
        }
        Ok(())
    }

    /// Queues a validated request; returns its slab index.
    pub fn add_request(&mut self, req: EngineRequest) -> CoreResult<ReqIdx> {
        self.validate(&req)?;
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let request = Request::new(req, arrival, self.cfg.max_model_len);
        let idx = match self.free_slots.pop() {
            Some(i) => i,
            None => {
                self.requests.push(None);
                self.requests.len() - 1
            }
        };
        self.ids.insert(request.request_id.clone(), idx);
        self.waiting.push_back(idx, (request.priority, arrival));
        self.requests[idx] = Some(request);
        Ok(idx)
    }

    /// Looks up a live request's index by id.
    pub fn index_of(&self, request_id: &str) -> Option<ReqIdx> {
        self.ids.get(request_id).copied()
    }

    pub fn request(&self, idx: ReqIdx) -> Option<&Request> {
        self.requests.get(idx).and_then(Option::as_ref)
    }

    pub fn request_mut(&mut self, idx: ReqIdx) -> Option<&mut Request> {
        self.requests.get_mut(idx).and_then(Option::as_mut)
    }

    fn req(&self, idx: ReqIdx) -> &Request {
        self.requests[idx].as_ref().expect("scheduler indices point at live requests")
    }

    fn req_mut(&mut self, idx: ReqIdx) -> &mut Request {
        self.requests[idx].as_mut().expect("scheduler indices point at live requests")
    }

    /// Ends a request that is still waiting or running: takes it out of its queue, frees its
    /// blocks and records why. The request stays in the slab until [`Self::release`].
    pub fn finish_request(&mut self, idx: ReqIdx, status: RequestStatus, stop_reason: Option<StopReason>) {
        debug_assert!(status.is_finished());
        let req = self.req(idx);
        if req.is_finished() {
            return;
        }
        let key = (req.priority, req.arrival);
        match req.status {
            RequestStatus::Running => self.running.retain(|&i| i != idx),
            _ => {
                self.waiting.remove(idx, key);
            }
        }
        self.kv.free(idx);
        self.finished_since_step.push(idx);
        let req = self.req_mut(idx);
        req.status = status;
        req.stop_reason = stop_reason;
    }

    /// Records that a stop string ended the request. A request already capped by length on
    /// the same token counts as stopped, as in vLLM.
    pub fn stop_on_string(&mut self, idx: ReqIdx, stop: String) {
        if self.req(idx).is_finished() {
            let req = self.req_mut(idx);
            req.status = RequestStatus::FinishedStopped;
            req.stop_reason = Some(StopReason::Str(stop));
        } else {
            self.finish_request(idx, RequestStatus::FinishedStopped, Some(StopReason::Str(stop)));
        }
    }

    /// Takes a finished request out of the slab, freeing its index and id for reuse.
    pub fn release(&mut self, idx: ReqIdx) -> Request {
        let req = self.requests[idx].take().expect("release of a live request");
        debug_assert!(req.is_finished());
        self.ids.remove(&req.request_id);
        self.free_slots.push(idx);
        req
    }

    pub fn has_unfinished_requests(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Ids of every waiting or running request, running first.
    pub fn unfinished_request_ids(&self) -> Vec<String> {
        let live = self.running.iter().copied().chain(self.waiting.iter());
        live.map(|i| self.req(i).request_id.clone()).collect()
    }

    /// Forgets the step awaiting `update`, after its execution failed.
    pub fn discard_pending_step(&mut self) {
        self.pending = None;
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn running(&self) -> &[ReqIdx] {
        &self.running
    }

    pub fn waiting(&self) -> impl Iterator<Item = ReqIdx> + '_ {
        self.waiting.iter()
    }

    pub fn kv_cache(&self) -> &KVCacheManager {
        &self.kv
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_prefix_cache()
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_preemptions: self.num_preemptions,
            num_free_blocks: self.kv.num_free_blocks(),
        }
    }

    /// Preempts by recompute: frees the request's blocks, forgets its computed tokens and puts
    /// it back at the head of the waiting queue.
    fn preempt(&mut self, idx: ReqIdx) {
        self.running.retain(|&i| i != idx);
        self.kv.free(idx);
        self.num_preemptions += 1;
        let req = self.req_mut(idx);
        req.status = RequestStatus::Preempted;
        req.num_computed_tokens = 0;
        req.num_encoded_mm_items = 0;
        req.num_preemptions += 1;
        if req.runner_view == RunnerView::Known {
            req.runner_view = RunnerView::Stale;
        }
        let key = (req.priority, req.arrival);
        self.waiting.push_front(idx, key);
    }

    /// The running request to preempt when blocks run out: the most recently admitted under
    /// FCFS, the one with the largest (priority, arrival) under the priority policy.
    fn pick_victim(&self) -> Option<ReqIdx> {
        match self.cfg.policy {
            SchedulingPolicy::Fcfs => self.running.last().copied(),
            SchedulingPolicy::Priority => {
                self.running.iter().copied().max_by_key(|&i| (self.req(i).priority, self.req(i).arrival))
            }
        }
    }
}
