//! Output processing after each step: incremental detokenization, stop strings, and building
//! the [`RequestOutput`]s callers receive (final-only for offline use, deltas when streaming).
//!
//! State is one slot per scheduler index; a slot lives from `add_request` to the request's final
//! output. Cost per accepted token: one detokenizer step and, when the request has stop strings,
//! a search over at most `new bytes + longest stop - 1` bytes.

use crate::request::{FinishReason, ReqIdx, Request, StopReason, TokenId};
use crate::tokenizer::stop::{find_stop_string, hold_back_len};
use crate::tokenizer::{IncrementalDetokenizer, Tokenizer};

/// What a caller receives for a request: everything on finish, or what is new since the last
/// output when the engine streams.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutput {
    pub request_id: String,
    /// Set on the final output only.
    pub prompt_token_ids: Vec<TokenId>,
    pub token_ids: Vec<TokenId>,
    pub text: String,
    pub finished: bool,
    pub finish_reason: Option<FinishReason>,
    pub stop_reason: Option<StopReason>,
    /// Prompt tokens served from the prefix cache when the request was first scheduled.
    pub num_cached_tokens: usize,
}

struct SlotState {
    detok: Option<IncrementalDetokenizer>,
    sent_tokens: usize,
    sent_text: usize,
    hold_back: usize,
}

#[derive(Default)]
pub(crate) struct OutputProcessor {
    slots: Vec<Option<SlotState>>,
}

impl OutputProcessor {
    pub fn add(&mut self, idx: ReqIdx, req: &Request, tokenizer: Option<&Tokenizer>) {
        let detok = tokenizer
            .filter(|_| req.sampling.detokenize)
            .map(|t| t.new_detokenizer(req.prompt_token_ids(), req.sampling.skip_special_tokens));
        if self.slots.len() <= idx {
            self.slots.resize_with(idx + 1, || None);
        }
        let hold_back = hold_back_len(&req.sampling.stop);
        self.slots[idx] = Some(SlotState { detok, sent_tokens: 0, sent_text: 0, hold_back });
    }

    /// Detokenizes an accepted token and checks stop strings; returns the stop string that
    /// ended the request, with `req.output_text` already cut.
    pub fn process_token(
        &mut self,
        idx: ReqIdx,
        req: &mut Request,
        token: TokenId,
        stopped_by_token: bool,
        tokenizer: Option<&Tokenizer>,
    ) -> Option<String> {
        let slot = self.slots[idx].as_mut()?;
        let (Some(detok), Some(tok)) = (slot.detok.as_mut(), tokenizer) else { return None };
        // A stop token's own text is left out unless the caller asked for it.
        if stopped_by_token && !req.sampling.include_stop_str_in_output {
            return None;
        }
        let new_len = detok.step(tok, token, &mut req.output_text);
        if req.sampling.stop.is_empty() || req.num_output_tokens() <= req.sampling.min_tokens {
            return None;
        }
        let m = find_stop_string(&req.output_text, new_len, &req.sampling.stop)?;
        let stop = &req.sampling.stop[m.stop_index];
        let cut = if req.sampling.include_stop_str_in_output { m.start + stop.len() } else { m.start };
        req.output_text.truncate(cut);
        Some(stop.clone())
    }

    /// The delta since the last streamed output, holding back text a stop string could still
    /// claim unless the request has finished.
    pub fn delta_output(&mut self, idx: ReqIdx, req: &Request) -> RequestOutput {
        let slot = self.slots[idx].as_mut().expect("output slot of a live request");
        // The first delta carries the prompt (as the final output does), so a stream's consumer
        // has it from its first output on: usage counts, and an image prompt's expanded ids.
        let first = slot.sent_tokens == 0;
        let out_ids = req.output_token_ids();
        let token_ids = out_ids[slot.sent_tokens.min(out_ids.len())..].to_vec();
        slot.sent_tokens = out_ids.len();
        let text = &req.output_text;
        let mut end = if req.is_finished() { text.len() } else { text.len().saturating_sub(slot.hold_back) };
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let start = slot.sent_text.min(end);
        slot.sent_text = end.max(slot.sent_text);
        RequestOutput {
            request_id: req.request_id.clone(),
            prompt_token_ids: if first { req.all_token_ids[..req.prompt_len].to_vec() } else { Vec::new() },
            token_ids,
            text: text[start..end].to_string(),
            finished: req.is_finished(),
            finish_reason: req.status.finish_reason(),
            stop_reason: req.stop_reason.clone(),
            num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
        }
    }

    /// The final output of a released request; `streamed` leaves out what deltas already sent.
    pub fn final_output(&mut self, idx: ReqIdx, mut req: Request, streamed: bool) -> RequestOutput {
        let mut out = if streamed { self.delta_output(idx, &req) } else { full_output(&mut req) };
        out.prompt_token_ids = req.all_token_ids[..req.prompt_len].to_vec();
        self.slots[idx] = None;
        out
    }
}

fn full_output(req: &mut Request) -> RequestOutput {
    RequestOutput {
        request_id: std::mem::take(&mut req.request_id),
        prompt_token_ids: Vec::new(),
        token_ids: req.output_token_ids().to_vec(),
        text: std::mem::take(&mut req.output_text),
        finished: true,
        finish_reason: req.status.finish_reason(),
        stop_reason: req.stop_reason.take(),
        num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
    }
}
