//! [`EngineCore`]: the synchronous engine handle. It owns the scheduler, the tokenizer and the
//! output processor, and runs one step as `schedule -> runner -> update`. Python's `LLM` and the
//! [`super::AsyncEngine`] both drive this same type.
//!
//! Invariant: every request accepted by `add_request(s)` comes back in exactly one final
//! [`RequestOutput`] (finished, length-capped or aborted).

use std::collections::HashSet;
use std::sync::Arc;

use super::output::{OutputProcessor, RequestOutput};
use crate::config::EngineConfig;
use crate::error::{CoreError, CoreResult};
use crate::request::{EngineRequest, RequestStatus, TokenId};
use crate::scheduler::{Scheduler, SchedulerOutput, TokenEvent};
use crate::tokenizer::Tokenizer;

/// Executes one scheduled step and returns one sampled token per scheduled request, in the
/// step's request order. Implemented by the Python runner through the bindings, and by any
/// Rust program that embeds the engine.
pub trait ModelRunner {
    fn execute_model(&mut self, batch: &SchedulerOutput) -> CoreResult<Vec<TokenId>>;
}

pub struct EngineCore {
    scheduler: Scheduler,
    tokenizer: Option<Arc<Tokenizer>>,
    processor: OutputProcessor,
    stream_outputs: bool,
    /// Final outputs produced outside `update` (aborts), handed out by the next `update`.
    pending_outputs: Vec<RequestOutput>,
}

impl EngineCore {
    /// Builds the engine; without a tokenizer, outputs carry token ids and no text.
    pub fn new(cfg: EngineConfig, tokenizer: Option<Arc<Tokenizer>>) -> CoreResult<Self> {
        cfg.validate()?;
        let mut scheduler = Scheduler::new(cfg.scheduler.clone(), &cfg.cache);
        scheduler.set_eos_token_id(tokenizer.as_ref().and_then(|t| t.eos_token_ids().first().copied()));
        Ok(Self {
            scheduler,
            tokenizer,
            processor: OutputProcessor::default(),
            stream_outputs: cfg.stream_outputs,
            pending_outputs: Vec::new(),
        })
    }

    pub fn tokenizer(&self) -> Option<&Arc<Tokenizer>> {
        self.tokenizer.as_ref()
    }

    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Overrides the EOS token (e.g. from `generation_config.json` read by the frontend).
    pub fn set_eos_token_id(&mut self, eos: Option<TokenId>) {
        self.scheduler.set_eos_token_id(eos);
    }

    /// Tokenizes prompts in parallel.
    pub fn encode_prompts(
        &self,
        prompts: &[String],
        add_special_tokens: bool,
    ) -> CoreResult<Vec<Vec<TokenId>>> {
        let tok = self.tokenizer.as_ref().ok_or_else(|| {
            CoreError::Tokenizer("this engine has no tokenizer: pass prompt token ids instead of text".into())
        })?;
        tok.encode_batch(prompts, add_special_tokens)
    }

    /// Adds one request.
    pub fn add_request(&mut self, req: EngineRequest) -> CoreResult<()> {
        self.add_requests(vec![req])
    }

    /// Adds a batch atomically: if any request is invalid, none is queued and the error names it.
    pub fn add_requests(&mut self, mut reqs: Vec<EngineRequest>) -> CoreResult<()> {
        let mut seen = HashSet::with_capacity(reqs.len());
        for req in &mut reqs {
            self.prepare(req);
            self.scheduler.validate(req)?;
            if !seen.insert(req.request_id.as_str()) {
                return Err(CoreError::DuplicateRequestId(req.request_id.clone()));
            }
        }
        for req in reqs {
            let idx = self.scheduler.add_request(req)?;
            let request = self.scheduler.request(idx).expect("just added");
            self.processor.add(idx, request, self.tokenizer.as_deref());
        }
        Ok(())
    }

    /// The tokenizer's other EOS ids stop a request like `stop_token_ids`, as vLLM does with
    /// the ids from `generation_config.json`.
    fn prepare(&self, req: &mut EngineRequest) {
        let Some(tok) = &self.tokenizer else { return };
        if req.sampling.ignore_eos {
            return;
        }
        for &id in tok.eos_token_ids().iter().skip(1) {
            if !req.sampling.stop_token_ids.contains(&id) {
                req.sampling.stop_token_ids.push(id);
            }
        }
    }

    /// Aborts requests by id; unknown or finished ids are ignored. Each aborted request's final
    /// output (finish_reason "abort") is returned by the next `update`.
    pub fn abort_requests(&mut self, request_ids: &[String]) -> usize {
        let mut n = 0;
        for id in request_ids {
            let Some(idx) = self.scheduler.index_of(id) else { continue };
            self.scheduler.finish_request(idx, RequestStatus::FinishedAborted, None);
            let req = self.scheduler.release(idx);
            self.pending_outputs.push(self.processor.final_output(idx, req, self.stream_outputs));
            n += 1;
        }
        n
    }

    /// Aborts every unfinished request, e.g. after a runner failure left the last step
    /// half-applied. Their final outputs come from the next `update`.
    pub fn abort_all_requests(&mut self) -> usize {
        let ids = self.scheduler.unfinished_request_ids();
        self.scheduler.discard_pending_step();
        self.abort_requests(&ids)
    }

    /// Schedules the next step.
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.scheduler.schedule()
    }

    /// Applies the last step's sampled tokens and returns the outputs it produced: final outputs
    /// only, or also deltas of unfinished requests when streaming.
    pub fn update(&mut self, sampled: &[TokenId]) -> CoreResult<Vec<RequestOutput>> {
        let events = self.scheduler.update_from_output(sampled)?;
        let mut outputs = std::mem::take(&mut self.pending_outputs);
        for ev in events {
            self.process_event(ev, &mut outputs);
        }
        Ok(outputs)
    }

    fn process_event(&mut self, ev: TokenEvent, outputs: &mut Vec<RequestOutput>) {
        let tok = self.tokenizer.as_deref();
        let req = self.scheduler.request_mut(ev.idx).expect("event of a live request");
        let stop = self.processor.process_token(ev.idx, req, ev.token, ev.stopped_by_token, tok);
        if let Some(stop) = stop {
            self.scheduler.stop_on_string(ev.idx, stop);
        }
        let req = self.scheduler.request(ev.idx).expect("event of a live request");
        if req.is_finished() {
            let req = self.scheduler.release(ev.idx);
            outputs.push(self.processor.final_output(ev.idx, req, self.stream_outputs));
        } else if self.stream_outputs {
            outputs.push(self.processor.delta_output(ev.idx, req));
        }
    }

    /// One full step with a runner. An empty schedule skips the runner.
    pub fn step(&mut self, runner: &mut dyn ModelRunner) -> CoreResult<Vec<RequestOutput>> {
        let batch = self.schedule();
        let sampled = if batch.is_empty() { Vec::new() } else { runner.execute_model(&batch)? };
        self.update(&sampled)
    }

    /// True while any request is waiting, running, or has a final output not yet handed out.
    pub fn has_unfinished_requests(&self) -> bool {
        self.scheduler.has_unfinished_requests() || !self.pending_outputs.is_empty()
    }

    /// Drops every cached prefix; refused (false) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.scheduler.reset_prefix_cache()
    }
}
