//! A request's state inside the core: its tokens, the sampling fields the core acts on, and its
//! status machine `Waiting -> Running -> (Preempted -> Waiting ->)* Finished*`.
//!
//! The scheduler owns every [`Request`] by value in one slab and refers to them by [`ReqIdx`];
//! the string id is looked up only when a request is added or aborted.

use crate::error::{CoreError, CoreResult};
use crate::kv_cache::hashing::{BlockHash, MultiModalFeature};

/// Index of a request in the scheduler's slab. Stable for the request's lifetime.
pub type ReqIdx = usize;
/// A token id as the tokenizer produces it.
pub type TokenId = u32;

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Preempted by recompute: blocks freed, back at the head of the waiting queue.
    Preempted,
    FinishedStopped,
    FinishedLengthCapped,
    FinishedAborted,
}

impl RequestStatus {
    pub fn is_finished(self) -> bool {
        matches!(self, Self::FinishedStopped | Self::FinishedLengthCapped | Self::FinishedAborted)
    }

    pub fn finish_reason(self) -> Option<FinishReason> {
        match self {
            Self::FinishedStopped => Some(FinishReason::Stop),
            Self::FinishedLengthCapped => Some(FinishReason::Length),
            Self::FinishedAborted => Some(FinishReason::Abort),
            _ => None,
        }
    }
}

/// Why a request finished, as vLLM's `CompletionOutput.finish_reason` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    Stop,
    Length,
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// What stopped a request that finished with [`FinishReason::Stop`]; `None` for EOS.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StopReason {
    TokenId(TokenId),
    Str(String),
}

/// The sampling fields the core needs: stop conditions, lengths, and the per-request values the
/// runner's batched sampler reads from the step arrays.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    pub max_tokens: Option<usize>,
    pub min_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<TokenId>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    /// Detokenize the output at all; off saves the work when only token ids are wanted.
    pub detokenize: bool,
    pub logprobs: Option<u32>,
    pub prompt_logprobs: Option<u32>,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub seed: Option<i64>,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            max_tokens: Some(16),
            min_tokens: 0,
            ignore_eos: false,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            detokenize: true,
            logprobs: None,
            prompt_logprobs: None,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
        }
    }
}

impl SamplingOptions {
    /// Checks each field against vLLM's bounds; the error names the field, bound and value.
    pub fn validate(&self) -> CoreResult<()> {
        if let Some(m) = self.max_tokens {
            if m < 1 {
                return Err(CoreError::invalid("max_tokens", ">= 1", m));
            }
            if self.min_tokens > m {
                return Err(CoreError::invalid(
                    "min_tokens",
                    format!("<= max_tokens ({m})"),
                    self.min_tokens,
                ));
            }
        }
        check_range("temperature", self.temperature, 0.0, f32::INFINITY, ">= 0")?;
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(CoreError::invalid("top_p", "in (0, 1]", self.top_p));
        }
        if self.top_k < -1 {
            return Err(CoreError::invalid("top_k", "-1 (disable), 0 (disable) or >= 1", self.top_k));
        }
        check_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")?;
        // vLLM >= 0.8.4 puts no upper bound on it.
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(CoreError::invalid(
                "repetition_penalty",
                "a finite number > 0",
                self.repetition_penalty,
            ));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(CoreError::invalid("stop", "a list of non-empty strings", "an empty string"));
        }
        Ok(())
    }
}

fn check_range(param: &str, v: f32, lo: f32, hi: f32, bound: &str) -> CoreResult<()> {
    if v.is_nan() || v < lo || v > hi {
        return Err(CoreError::invalid(param, bound, v));
    }
    Ok(())
}

/// What the model runner knows of a request, deciding what the next step sends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunnerView {
    /// Never scheduled: the next step sends its full data once.
    Unseen,
    /// The runner holds its state: the next step sends only what changed.
    Known,
    /// Preempted since the runner last saw it: the next step resends its whole block table.
    Stale,
}

/// What a caller submits.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    pub request_id: String,
    pub prompt_token_ids: Vec<TokenId>,
    pub sampling: SamplingOptions,
    /// Lower runs first under the priority policy.
    pub priority: i32,
    /// Separates prefix-cache namespaces: requests with different salts never share blocks.
    pub cache_salt: Option<String>,
    /// Multimodal items in the prompt; their content hashes enter the block hashes they overlap.
    pub mm_features: Vec<MultiModalFeature>,
}

impl EngineRequest {
    pub fn new(
        request_id: impl Into<String>,
        prompt_token_ids: Vec<TokenId>,
        sampling: SamplingOptions,
    ) -> Self {
        Self {
            request_id: request_id.into(),
            prompt_token_ids,
            sampling,
            priority: 0,
            cache_salt: None,
            mm_features: Vec::new(),
        }
    }
}

/// A request's live state.
#[derive(Debug)]
pub struct Request {
    pub request_id: String,
    pub prompt_len: usize,
    /// Prompt followed by output tokens.
    pub all_token_ids: Vec<TokenId>,
    pub sampling: SamplingOptions,
    /// Effective cap on output tokens (`max_tokens` limited by `max_model_len`).
    pub max_output_tokens: usize,
    pub priority: i32,
    /// Monotonic arrival counter; orders FCFS and breaks priority ties.
    pub arrival: u64,
    pub status: RequestStatus,
    /// Tokens whose KV is in the cache (computed or hit), counted at schedule time.
    pub num_computed_tokens: usize,
    /// Prompt tokens served from the prefix cache at first scheduling; `None` until scheduled.
    pub num_cached_tokens: Option<usize>,
    pub num_preemptions: u32,
    pub cache_salt: Option<String>,
    pub mm_features: Vec<MultiModalFeature>,
    /// Leading `mm_features` already encoded (or inside a prefix hit); see the encoder budget.
    pub num_encoded_mm_items: usize,
    /// Hashes of the request's full blocks, extended as tokens arrive.
    pub block_hashes: Vec<BlockHash>,
    pub output_text: String,
    pub stop_reason: Option<StopReason>,
    pub runner_view: RunnerView,
}

impl Request {
    pub fn new(req: EngineRequest, arrival: u64, max_model_len: usize) -> Self {
        let prompt_len = req.prompt_token_ids.len();
        let room = max_model_len.saturating_sub(prompt_len);
        let max_output_tokens = req.sampling.max_tokens.map_or(room, |m| m.min(room));
        Self {
            request_id: req.request_id,
            prompt_len,
            all_token_ids: req.prompt_token_ids,
            sampling: req.sampling,
            max_output_tokens,
            priority: req.priority,
            arrival,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            num_cached_tokens: None,
            num_preemptions: 0,
            cache_salt: req.cache_salt,
            mm_features: req.mm_features,
            num_encoded_mm_items: 0,
            block_hashes: Vec::new(),
            output_text: String::new(),
            stop_reason: None,
            runner_view: RunnerView::Unseen,
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.all_token_ids.len() - self.prompt_len
    }

    pub fn prompt_token_ids(&self) -> &[TokenId] {
        &self.all_token_ids[..self.prompt_len]
    }

    pub fn output_token_ids(&self) -> &[TokenId] {
        &self.all_token_ids[self.prompt_len..]
    }

    pub fn is_finished(&self) -> bool {
        self.status.is_finished()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_sampling_options_are_valid() {
        SamplingOptions::default().validate().unwrap();
    }

    #[test]
    fn invalid_top_p_names_the_field() {
        let s = SamplingOptions { top_p: 1.5, ..Default::default() };
        assert_eq!(s.validate().unwrap_err().to_string(), "`top_p` must be in (0, 1]. Given: 1.5");
    }

    #[test]
    fn min_tokens_above_max_tokens_is_refused() {
        let s = SamplingOptions { max_tokens: Some(4), min_tokens: 5, ..Default::default() };
        assert!(s.validate().unwrap_err().to_string().contains("min_tokens"));
    }

    #[test]
    fn output_cap_respects_max_model_len() {
        let req = EngineRequest::new(
            "a",
            vec![1; 10],
            SamplingOptions { max_tokens: Some(100), ..Default::default() },
        );
        let r = Request::new(req, 0, 32);
        assert_eq!(r.max_output_tokens, 22);
    }
}
