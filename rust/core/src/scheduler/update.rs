//! `update_from_output()`: takes the sampled token of each request of the last step, appends it
//! where the step completed the request's known tokens, and applies the token-level stop rules
//! (length, EOS, `stop_token_ids`) in vLLM v1's order. Stop strings need text and are checked
//! by the engine's output processor afterwards.

use super::Scheduler;
use crate::error::{CoreError, CoreResult};
use crate::request::{ReqIdx, Request, RequestStatus, StopReason, TokenId};

/// A token accepted into a request, and whether a token-level rule finished the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenEvent {
    pub idx: ReqIdx,
    pub token: TokenId,
    /// The request finished on this token (length, EOS or a stop token id).
    pub finished: bool,
    /// The request finished because this token is EOS or a stop token id.
    pub stopped_by_token: bool,
}

/// The request order and sampling mask of the step `update` is waiting for.
#[derive(Debug, Default)]
pub(super) struct PendingStep {
    pub req_indices: Vec<ReqIdx>,
    pub needs_sample: Vec<bool>,
}

impl Scheduler {
    /// Applies one step's sampled tokens, one per scheduled request in the step's order
    /// (entries for prefill chunks that did not reach the prompt's end are ignored).
    pub fn update_from_output(&mut self, sampled: &[TokenId]) -> CoreResult<Vec<TokenEvent>> {
        let Some(step) = self.pending.take() else {
            return Err(CoreError::StepMismatch {
                param: "sampled".into(),
                bound: "given once per schedule()".into(),
                value: "an update with no step scheduled".into(),
            });
        };
        if sampled.len() != step.req_indices.len() {
            let n = step.req_indices.len();
            self.pending = Some(step);
            return Err(CoreError::StepMismatch {
                param: "sampled".into(),
                bound: format!("one token per scheduled request ({n})"),
                value: format!("{} tokens", sampled.len()),
            });
        }
        let mut events = Vec::with_capacity(sampled.len());
        for ((&idx, &keep), &token) in step.req_indices.iter().zip(&step.needs_sample).zip(sampled) {
            // A request aborted between schedule and update is no longer running.
            let running = self.request(idx).is_some_and(|r| r.status == RequestStatus::Running);
            if keep && running {
                events.push(self.append_token(idx, token));
            }
        }
        Ok(events)
    }

    fn append_token(&mut self, idx: ReqIdx, token: TokenId) -> TokenEvent {
        let eos = self.eos_token_id;
        let req = self.req_mut(idx);
        req.all_token_ids.push(token);
        let verdict = check_stop(req, token, eos);
        let mut event = TokenEvent { idx, token, finished: false, stopped_by_token: false };
        if let Some((status, reason)) = verdict {
            event.finished = true;
            event.stopped_by_token = status == RequestStatus::FinishedStopped;
            self.finish_request(idx, status, reason);
        }
        event
    }
}

/// vLLM v1's order: the length cap first, then nothing before `min_tokens`, then EOS (unless
/// `ignore_eos`), then `stop_token_ids`.
fn check_stop(
    req: &Request,
    token: TokenId,
    eos: Option<TokenId>,
) -> Option<(RequestStatus, Option<StopReason>)> {
    let num_output = req.num_output_tokens();
    if num_output >= req.max_output_tokens {
        return Some((RequestStatus::FinishedLengthCapped, None));
    }
    if num_output < req.sampling.min_tokens {
        return None;
    }
    if !req.sampling.ignore_eos && eos == Some(token) {
        return Some((RequestStatus::FinishedStopped, None));
    }
    if req.sampling.stop_token_ids.contains(&token) {
        return Some((RequestStatus::FinishedStopped, Some(StopReason::TokenId(token))));
    }
    None
}
