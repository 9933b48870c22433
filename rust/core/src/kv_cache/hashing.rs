//! CONTRACT STUB — to be implemented.
use crate::request::{Request, TokenId};

/// Hash of a full block, chained over its parent's hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

/// A multimodal item occupying `length` prompt positions from `offset`, identified by a content hash.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MultiModalFeature {
    pub identifier: String,
    pub offset: usize,
    pub length: usize,
}

pub fn hash_block_tokens(_parent: Option<BlockHash>, _tokens: &[TokenId], _extra_keys: &[&[u8]]) -> BlockHash {
    todo!()
}

/// Extends `req.block_hashes` to cover every full block of `req.all_token_ids`.
pub fn extend_block_hashes(_req: &mut Request, _block_size: usize) {
    todo!()
}
