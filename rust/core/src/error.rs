//! The core's one error type. Every fallible core call returns [`CoreError`]; the bindings map
//! each variant to one Python exception class in a single `From` impl, so the hierarchy a user
//! catches is decided here and nowhere else.
//!
//! Messages name the parameter, the bound and the value given, in the style
//! "`max_tokens` must be >= 1. Given: 0".

use thiserror::Error;

/// Result alias used across the core.
pub type CoreResult<T> = Result<T, CoreError>;

/// Everything the engine core can refuse or fail at.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CoreError {
    /// A request parameter is outside its allowed range.
    #[error("`{param}` must be {bound}. Given: {value}")]
    InvalidParameter { param: String, bound: String, value: String },
    /// The prompt plus the tokens asked for cannot fit in `max_model_len`. The message carries
    /// vLLM's wording ("longer than the maximum model length of N"), which scripts match on.
    #[error(
        "the prompt of request `{request_id}` has {num_tokens} tokens, but `max_model_len` is \
         {max_model_len}: the prompt must be shorter than `max_model_len` (the decoder prompt \
         (length {num_tokens}) plus at least one output token is longer than the maximum model \
         length of {max_model_len})"
    )]
    PromptTooLong { request_id: String, num_tokens: usize, max_model_len: usize },
    /// A request id that is already queued or running was added again.
    #[error("request id `{0}` is already in use by an unfinished request")]
    DuplicateRequestId(String),
    /// An engine configuration value is invalid.
    #[error("`{param}` must be {bound}. Given: {value}")]
    InvalidConfig { param: String, bound: String, value: String },
    /// The KV cache cannot hold even one `max_model_len` sequence.
    #[error(
        "the KV cache has {num_blocks} blocks of {block_size} tokens ({capacity} tokens), fewer \
         than one sequence of `max_model_len`={max_model_len} needs; the largest length that fits \
         is {capacity}. Lower `max_model_len`, give the cache more memory, quantize the model or \
         raise `tensor_parallel_size`"
    )]
    KvCacheTooSmall { num_blocks: usize, block_size: usize, capacity: usize, max_model_len: usize },
    /// The tokenizer files could not be read or used.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// The step arrays handed back do not match the step that was scheduled.
    #[error("`{param}` must be {bound}. Given: {value}")]
    StepMismatch { param: String, bound: String, value: String },
    /// The model runner failed while executing a step.
    #[error("model runner failed: {0}")]
    Runner(String),
    /// The shared-memory step channel between tensor-parallel ranks failed, timed out or was
    /// aborted.
    #[error("step channel: {0}")]
    StepChannel(String),
    /// The engine has been shut down.
    #[error("the engine is shut down")]
    EngineClosed,
}

impl CoreError {
    /// Shorthand for [`CoreError::InvalidParameter`].
    pub fn invalid(param: &str, bound: impl Into<String>, value: impl ToString) -> Self {
        CoreError::InvalidParameter {
            param: param.to_string(),
            bound: bound.into(),
            value: value.to_string(),
        }
    }

    /// Shorthand for [`CoreError::InvalidConfig`].
    pub fn config(param: &str, bound: impl Into<String>, value: impl ToString) -> Self {
        CoreError::InvalidConfig { param: param.to_string(), bound: bound.into(), value: value.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_parameter_names_param_bound_and_value() {
        let e = CoreError::invalid("max_tokens", ">= 1", 0);
        assert_eq!(e.to_string(), "`max_tokens` must be >= 1. Given: 0");
    }

    #[test]
    fn kv_cache_too_small_names_the_largest_length_that_fits() {
        let e =
            CoreError::KvCacheTooSmall { num_blocks: 4, block_size: 16, capacity: 64, max_model_len: 128 };
        let msg = e.to_string();
        assert!(msg.contains("largest length that fits is 64"), "{msg}");
        assert!(msg.contains("max_model_len"), "{msg}");
    }
}
