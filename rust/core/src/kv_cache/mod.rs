//! The paged KV cache's bookkeeping: which physical blocks each request owns, which full blocks
//! hold which token prefixes, and which free blocks can be reused. The tensors themselves live in
//! the model runner; this module only hands out block ids.

pub mod block_pool;
pub mod hashing;
pub mod manager;

pub use block_pool::{BlockId, BlockPool, NULL_BLOCK};
pub use hashing::{BlockHash, MultiModalFeature};
pub use manager::KVCacheManager;
