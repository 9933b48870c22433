//! `schedule()`: one token budget shared by the running requests (decodes and unfinished
//! prefills, served first) and then the waiting ones. When a running request cannot get blocks,
//! the policy's victim is preempted by recompute and nobody is admitted in that step.
//! `long_prefill_token_threshold` caps each request's tokens in the step (vLLM's rule: only
//! while more than one request is live); with chunked prefill off, a waiting request is admitted
//! only when its (capped) tokens fit in what is left of the budget, else admission stops there.
//! Chunks that start multimodal items also draw on the step's encoder budget (see
//! `encoder_budget`).

use super::encoder_budget::{fit_encoder_budget, mark_encoded};
use super::output::{ScheduledRequest, SchedulerOutput};
use super::update::PendingStep;
use super::Scheduler;
use crate::request::{ReqIdx, RequestStatus};

/// What is left of a step's budgets while it is being scheduled.
struct StepBudget {
    tokens: usize,
    encoder: usize,
}

impl StepBudget {
    fn take(&mut self, s: &ScheduledRequest) {
        self.tokens -= s.num_new_tokens;
        self.encoder -= s.encoder_cost;
    }

    fn give_back(&mut self, s: &ScheduledRequest) {
        self.tokens += s.num_new_tokens;
        self.encoder += s.encoder_cost;
    }
}

impl Scheduler {
    /// Picks this step's requests, allocates their KV slots and emits the step's arrays.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut budget = StepBudget {
            tokens: self.cfg.max_num_batched_tokens,
            encoder: self.cfg.max_num_encoder_input_tokens,
        };
        let mut scheduled: Vec<ScheduledRequest> = Vec::with_capacity(self.running.len());
        let mut preempted = Vec::new();
        let cap = self.long_prefill_cap();
        self.schedule_running(&mut budget, cap, &mut scheduled, &mut preempted);
        if preempted.is_empty() {
            self.schedule_waiting(&mut budget, cap, &mut scheduled);
        }
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        let finished = std::mem::take(&mut self.finished_since_step);
        let out = self.build_output(step_id, scheduled, preempted, finished);
        self.pending = Some(PendingStep {
            req_indices: out.req_indices.iter().map(|&i| i as ReqIdx).collect(),
            needs_sample: out.needs_sample.clone(),
        });
        out
    }

    /// Most tokens one request may take this step.
    fn long_prefill_cap(&self) -> usize {
        let threshold = self.cfg.long_prefill_token_threshold;
        if threshold > 0 && self.running.len() + self.waiting.len() > 1 {
            threshold
        } else {
            usize::MAX
        }
    }

    fn schedule_running(
        &mut self,
        budget: &mut StepBudget,
        cap: usize,
        scheduled: &mut Vec<ScheduledRequest>,
        preempted: &mut Vec<ReqIdx>,
    ) {
        let mut i = 0;
        while i < self.running.len() && budget.tokens > 0 {
            let idx = self.running[i];
            let req = self.req(idx);
            let start = req.num_computed_tokens;
            let wanted = (req.num_tokens() - start).min(cap).min(budget.tokens);
            let (num_new_tokens, encoder_cost) =
                fit_encoder_budget(req, start, wanted, budget.encoder, self.cfg.disable_chunked_mm_input);
            if num_new_tokens == 0 {
                i += 1;
                continue;
            }
            match self.allocate_or_preempt(idx, num_new_tokens, scheduled, budget, preempted) {
                Some(new_block_ids) => {
                    let s = ScheduledRequest { idx, num_new_tokens, new_block_ids, encoder_cost };
                    budget.take(&s);
                    mark_encoded(self.req_mut(idx), start + num_new_tokens);
                    scheduled.push(s);
                    // A victim taken from before `i` shifts this request left.
                    i = self.running.iter().position(|&r| r == idx).map_or(i, |p| p + 1);
                }
                None => break,
            }
        }
    }

    /// Allocates slots for a running request, preempting victims until it fits. Returns `None`
    /// when the request itself had to be preempted.
    fn allocate_or_preempt(
        &mut self,
        idx: ReqIdx,
        num_new_tokens: usize,
        scheduled: &mut Vec<ScheduledRequest>,
        budget: &mut StepBudget,
        preempted: &mut Vec<ReqIdx>,
    ) -> Option<Vec<u32>> {
        loop {
            let req = self.requests[idx].as_mut().expect("running request is live");
            if let Some(blocks) = self.kv.allocate_slots(idx, req, num_new_tokens, &[], 0) {
                return Some(blocks);
            }
            let victim = self.pick_victim().expect("the request itself is running");
            // A victim already scheduled in this step gives its tokens back.
            if let Some(p) = scheduled.iter().position(|s| s.idx == victim) {
                budget.give_back(&scheduled.remove(p));
            }
            self.preempt(victim);
            preempted.push(victim);
            if victim == idx {
                return None;
            }
        }
    }

    fn schedule_waiting(
        &mut self,
        budget: &mut StepBudget,
        cap: usize,
        scheduled: &mut Vec<ScheduledRequest>,
    ) {
        while budget.tokens > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(idx) = self.waiting.peek() else { break };
            let req = self.requests[idx].as_mut().expect("waiting request is live");
            let (computed_blocks, num_computed) = self.kv.get_computed_blocks(req);
            let remaining = (req.num_tokens() - num_computed).min(cap);
            if !self.cfg.enable_chunked_prefill && remaining > budget.tokens {
                break;
            }
            let wanted = remaining.min(budget.tokens);
            let (num_new_tokens, encoder_cost) = fit_encoder_budget(
                req,
                num_computed,
                wanted,
                budget.encoder,
                self.cfg.disable_chunked_mm_input,
            );
            // Admission stays in queue order: a request whose items do not fit waits for a step.
            if num_new_tokens == 0 || (!self.cfg.enable_chunked_prefill && num_new_tokens < wanted) {
                break;
            }
            let Some(new_block_ids) =
                self.kv.allocate_slots(idx, req, num_new_tokens, &computed_blocks, num_computed)
            else {
                break;
            };
            self.waiting.pop();
            let req = self.req_mut(idx);
            req.status = RequestStatus::Running;
            req.num_computed_tokens = num_computed;
            req.num_cached_tokens.get_or_insert(num_computed);
            mark_encoded(req, num_computed + num_new_tokens);
            self.running.push(idx);
            let s = ScheduledRequest { idx, num_new_tokens, new_block_ids, encoder_cost };
            budget.take(&s);
            scheduled.push(s);
        }
    }
}
