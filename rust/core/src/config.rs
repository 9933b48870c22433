//! Engine configuration: one struct per component, each validated once at start-up.
//! Names and defaults follow vLLM v1's `CacheConfig` / `SchedulerConfig`.

use crate::error::{CoreError, CoreResult};

/// How waiting requests are ordered and which running request is preempted first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SchedulingPolicy {
    /// First come, first served; the most recently admitted running request is preempted.
    #[default]
    Fcfs,
    /// Lowest `priority` value first, arrival order breaking ties; the running request with the
    /// largest (priority, arrival) is preempted.
    Priority,
}

impl std::str::FromStr for SchedulingPolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> CoreResult<Self> {
        match s {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            other => {
                Err(CoreError::config("scheduling_policy", "one of 'fcfs', 'priority'", format!("'{other}'")))
            }
        }
    }
}

/// The paged KV cache's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the pool, including the reserved null block.
    pub num_blocks: usize,
    /// Reuse full blocks across requests whose token prefixes hash alike.
    pub enable_prefix_caching: bool,
    /// Set when every attention layer looks back at most this many tokens: blocks wholly
    /// outside the window are freed while a request runs, so memory follows the window.
    pub sliding_window: Option<usize>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self { block_size: 16, num_blocks: 1024, enable_prefix_caching: true, sliding_window: None }
    }
}

/// The scheduler's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulerConfig {
    /// Requests running at once.
    pub max_num_seqs: usize,
    /// Tokens per step, shared by decodes and prefill chunks.
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: usize,
    /// Split prompts longer than the remaining budget across steps. Off, a waiting prompt is
    /// admitted only when all its remaining tokens fit in the step's budget.
    pub enable_chunked_prefill: bool,
    /// vLLM's cap on one request's tokens per step (0: none), so a long prompt cannot starve the
    /// others of the budget. Not applied when a single request is live: nobody would starve.
    pub long_prefill_token_threshold: usize,
    pub policy: SchedulingPolicy,
    /// Multimodal placeholder tokens whose items may be encoded in one step.
    pub max_num_encoder_input_tokens: usize,
    /// vLLM's `disable_chunked_mm_input`: a chunk never splits a multimodal item (models that
    /// attend bidirectionally inside an image, e.g. Gemma 3, need its tokens in one step).
    pub disable_chunked_mm_input: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 4096,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            policy: SchedulingPolicy::Fcfs,
            max_num_encoder_input_tokens: 8192,
            disable_chunked_mm_input: false,
        }
    }
}

/// Everything the engine core is built from.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineConfig {
    pub cache: CacheConfig,
    pub scheduler: SchedulerConfig,
    /// Emit an output for every request that produced tokens in a step, not only on finish
    /// (streaming). The offline `generate` path leaves it off and pays for finished outputs only.
    pub stream_outputs: bool,
}

impl EngineConfig {
    /// Checks every bound once so the components can trust their config.
    pub fn validate(&self) -> CoreResult<()> {
        let c = &self.cache;
        let s = &self.scheduler;
        if c.block_size == 0 {
            return Err(CoreError::config("block_size", ">= 1", c.block_size));
        }
        if c.num_blocks < 2 {
            return Err(CoreError::config(
                "num_blocks",
                ">= 2 (one is the reserved null block)",
                c.num_blocks,
            ));
        }
        if s.max_num_seqs == 0 {
            return Err(CoreError::config("max_num_seqs", ">= 1", s.max_num_seqs));
        }
        if s.max_model_len == 0 {
            return Err(CoreError::config("max_model_len", ">= 1", s.max_model_len));
        }
        if s.max_num_batched_tokens < s.max_num_seqs {
            return Err(CoreError::config(
                "max_num_batched_tokens",
                format!(">= max_num_seqs ({})", s.max_num_seqs),
                s.max_num_batched_tokens,
            ));
        }
        if !s.enable_chunked_prefill && s.max_num_batched_tokens < s.max_model_len {
            return Err(CoreError::config(
                "max_num_batched_tokens",
                format!(">= max_model_len ({}) when chunked prefill is disabled", s.max_model_len),
                s.max_num_batched_tokens,
            ));
        }
        if s.long_prefill_token_threshold > s.max_model_len {
            return Err(CoreError::config(
                "long_prefill_token_threshold",
                format!("<= max_model_len ({})", s.max_model_len),
                s.long_prefill_token_threshold,
            ));
        }
        if c.sliding_window == Some(0) {
            return Err(CoreError::config("sliding_window", ">= 1 or None", 0));
        }
        let capacity = (c.num_blocks - 1) * c.block_size;
        // With a window, a request holds at most the window plus one step's chunk (and a block
        // of rounding on each side).
        let needed = match c.sliding_window {
            Some(w) => s.max_model_len.min(w + s.max_num_batched_tokens + 2 * c.block_size),
            None => s.max_model_len,
        };
        if capacity < needed {
            return Err(CoreError::KvCacheTooSmall {
                num_blocks: c.num_blocks - 1,
                block_size: c.block_size,
                capacity,
                max_model_len: s.max_model_len,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_config_is_valid() {
        EngineConfig::default().validate().unwrap();
    }

    #[test]
    fn too_small_cache_reports_capacity() {
        let mut cfg = EngineConfig::default();
        cfg.cache.num_blocks = 5;
        cfg.scheduler.max_model_len = 100;
        match cfg.validate() {
            Err(CoreError::KvCacheTooSmall { capacity, .. }) => assert_eq!(capacity, 64),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn unchunked_budget_must_hold_a_whole_prompt() {
        let mut cfg = EngineConfig::default();
        cfg.scheduler.enable_chunked_prefill = false;
        cfg.scheduler.max_num_batched_tokens = 1024;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("max_num_batched_tokens"), "{err}");
    }

    #[test]
    fn long_prefill_threshold_above_max_model_len_is_refused() {
        let mut cfg = EngineConfig::default();
        cfg.scheduler.long_prefill_token_threshold = 4097;
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("long_prefill_token_threshold") && err.contains("4097"), "{err}");
    }

    #[test]
    fn policy_parses_vllm_names() {
        assert_eq!("priority".parse::<SchedulingPolicy>().unwrap(), SchedulingPolicy::Priority);
        assert!("lifo".parse::<SchedulingPolicy>().is_err());
    }
}
