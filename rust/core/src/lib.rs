//! ferrollm's engine core: requests and their state machine, the scheduler (continuous batching,
//! chunked prefill, preemption by recompute), the paged KV block manager with prefix caching,
//! the tokenizer pipeline and the multimodal input cache. It holds no Python types: a Rust
//! program embeds it through [`engine::EngineCore`] (synchronous, driven by a
//! [`engine::ModelRunner`]) or [`engine::AsyncEngine`] (a tokio step loop with per-request output
//! streams), and the `ferrollm._core` Python module is a thin binding over the same handle.

pub mod broadcast;
pub mod config;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod mm_cache;
pub mod request;
pub mod scheduler;
pub mod tokenizer;

pub use config::{CacheConfig, EngineConfig, SchedulerConfig, SchedulingPolicy};
pub use error::{CoreError, CoreResult};
pub use request::{EngineRequest, FinishReason, RequestStatus, SamplingOptions, StopReason, TokenId};
