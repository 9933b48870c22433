//! CONTRACT STUB — to be implemented.
use super::block_pool::BlockId;
use crate::config::CacheConfig;
use crate::request::{ReqIdx, Request};

pub struct KVCacheManager;

impl KVCacheManager {
    pub fn new(_cfg: &CacheConfig) -> Self { todo!() }
    pub fn block_size(&self) -> usize { todo!() }
    pub fn num_free_blocks(&self) -> usize { todo!() }
    pub fn usage(&self) -> f64 { todo!() }
    /// Longest cached prefix of full blocks, never the whole request: (blocks, num tokens).
    pub fn get_computed_blocks(&mut self, _req: &mut Request) -> (Vec<BlockId>, usize) { todo!() }
    /// Takes the computed blocks and enough new blocks for `num_new_tokens` more tokens;
    /// returns every block id appended to the request's table, or `None` when out of blocks.
    pub fn allocate_slots(
        &mut self,
        _idx: ReqIdx,
        _req: &mut Request,
        _num_new_tokens: usize,
        _new_computed_blocks: &[BlockId],
        _num_new_computed_tokens: usize,
    ) -> Option<Vec<BlockId>> { todo!() }
    pub fn ref_cnt(&self, _block: BlockId) -> u32 { todo!() }
    pub fn free(&mut self, _idx: ReqIdx) { todo!() }
    pub fn block_ids(&self, _idx: ReqIdx) -> &[BlockId] { todo!() }
    pub fn reset_prefix_cache(&mut self) -> bool { todo!() }
    pub fn check_invariants(&self) -> Result<(), String> { todo!() }
}
