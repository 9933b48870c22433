//! What one `schedule()` hands the model runner: flat arrays for the step (the hot path, moved
//! into numpy without a copy by the bindings), plus the per-request data a stateful runner needs,
//! sent once for new requests and as diffs for the ones it already knows.
//!
//! Row `i` of every per-request array is the `i`-th scheduled request; running requests come
//! first in running order, then the requests admitted this step.

use crate::kv_cache::BlockId;
use crate::request::{ReqIdx, SamplingOptions, TokenId};

/// A request the runner sees for the first time: everything it needs to keep its own state.
#[derive(Debug, Clone, PartialEq)]
pub struct NewRequestData {
    pub req_index: ReqIdx,
    pub request_id: String,
    pub prompt_token_ids: Vec<TokenId>,
    pub sampling: SamplingOptions,
    pub block_ids: Vec<BlockId>,
    pub num_computed_tokens: usize,
}

/// A request the runner already knows: only what changed since its last step.
#[derive(Debug, Clone, PartialEq)]
pub struct CachedRequestData {
    pub req_index: ReqIdx,
    /// Back from preemption: `new_block_ids` replaces its whole block table, and its token ids
    /// (prompt and outputs so far) are recomputed from position 0.
    pub resumed_from_preemption: bool,
    pub new_block_ids: Vec<BlockId>,
    pub num_computed_tokens: usize,
}

/// The per-request sampling values, one entry per scheduled request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingArrays {
    pub temperature: Vec<f32>,
    pub top_p: Vec<f32>,
    pub top_k: Vec<i32>,
    pub min_p: Vec<f32>,
    /// -1 where the request has no seed.
    pub seeds: Vec<i64>,
    pub presence_penalty: Vec<f32>,
    pub frequency_penalty: Vec<f32>,
    pub repetition_penalty: Vec<f32>,
}

impl SamplingArrays {
    pub fn push(&mut self, s: &SamplingOptions) {
        self.temperature.push(s.temperature);
        self.top_p.push(s.top_p);
        self.top_k.push(s.top_k);
        self.min_p.push(s.min_p);
        self.seeds.push(s.seed.unwrap_or(-1));
        self.presence_penalty.push(s.presence_penalty);
        self.frequency_penalty.push(s.frequency_penalty);
        self.repetition_penalty.push(s.repetition_penalty);
    }
}

/// One step's work. Token-dimension arrays have `total_num_scheduled_tokens` entries;
/// request-dimension arrays have `num_reqs()` entries.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerOutput {
    /// Increases by one per `schedule()`; `update` must receive the latest step.
    pub step_id: u64,
    pub req_indices: Vec<i64>,
    pub num_scheduled_tokens: Vec<i32>,
    pub total_num_scheduled_tokens: usize,
    pub input_ids: Vec<i64>,
    pub positions: Vec<i64>,
    /// Physical KV slot of each token: `block_id * block_size + offset`.
    pub slot_mapping: Vec<i64>,
    /// Row-major `[num_reqs, max_num_blocks]`, padded with the null block (0).
    pub block_tables: Vec<i32>,
    pub max_num_blocks: usize,
    /// `[num_reqs + 1]` prefix sums of the scheduled token counts.
    pub query_start_loc: Vec<i32>,
    /// Context length of each request after this step (cached + scheduled tokens).
    pub seq_lens: Vec<i32>,
    /// Tokens already in the KV cache before this step.
    pub num_computed_tokens: Vec<i32>,
    /// Token index whose logits the sampler reads for each request (its last scheduled token).
    pub logits_indices: Vec<i64>,
    /// True where this step completes the request's known tokens, so its sampled token is
    /// kept; false for a prefill chunk that stops short of the prompt's end.
    pub needs_sample: Vec<bool>,
    pub sampling: SamplingArrays,
    pub scheduled_new_reqs: Vec<NewRequestData>,
    pub scheduled_cached_reqs: Vec<CachedRequestData>,
    /// Requests that finished or were aborted since the previous step: the runner drops their state.
    pub finished_req_indices: Vec<i64>,
    /// Requests preempted in this step (already freed; they are back in the waiting queue).
    pub preempted_req_indices: Vec<i64>,
}

impl SchedulerOutput {
    pub fn num_reqs(&self) -> usize {
        self.req_indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.req_indices.is_empty()
    }
}

/// One request's share of a step, collected while scheduling and turned into arrays at the end
/// (so a request preempted later in the same step can still be taken out).
#[derive(Debug, Clone)]
pub(crate) struct ScheduledRequest {
    pub idx: ReqIdx,
    pub num_new_tokens: usize,
    /// Blocks appended to the request's table this step (prefix hits included).
    pub new_block_ids: Vec<BlockId>,
    /// Placeholder tokens of the multimodal items this step encodes for the request.
    pub encoder_cost: usize,
}
