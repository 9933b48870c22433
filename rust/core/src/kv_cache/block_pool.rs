//! CONTRACT STUB — to be implemented.
use super::hashing::BlockHash;

pub type BlockId = u32;
pub const NULL_BLOCK: BlockId = 0;

pub struct BlockPool;

impl BlockPool {
    pub fn new(_num_blocks: usize, _enable_caching: bool) -> Self { todo!() }
    pub fn num_free_blocks(&self) -> usize { todo!() }
    pub fn get_cached_block(&self, _h: &BlockHash) -> Option<BlockId> { todo!() }
}
