//! The KV cache manager: per-request block tables over one [`BlockPool`], prefix-cache lookups and
//! the registration of newly filled blocks, in vLLM v1's vocabulary (`get_computed_blocks`,
//! `allocate_slots`, `free`).
//!
//! Tables are indexed by [`ReqIdx`], the scheduler's slab index, and grow on demand. Beside each
//! table the manager keeps how many of its leading blocks are already registered in the cache, so
//! each block is offered to the cache once.
//!
//! Invariants (checked by [`KVCacheManager::check_invariants`]): every block's `ref_cnt` equals the
//! number of tables holding it; no table holds a block twice or the null block; a table's
//! registered count never exceeds its length.
//!
//! Costs: `get_computed_blocks` hashes only blocks not hashed before and probes the cache once per
//! hit block plus once for the first miss; `allocate_slots` is O(blocks appended + blocks newly
//! registered); `free` is O(table length). Nothing here scans the pool except `reset_prefix_cache`
//! and `check_invariants`.

use super::block_pool::{BlockId, BlockPool, NULL_BLOCK};
use super::hashing::extend_block_hashes;
use crate::config::CacheConfig;
use crate::request::{ReqIdx, Request};

/// Prefix-cache lookups since the manager was built, counted in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Requests looked up.
    pub num_requests: u64,
    /// Tokens of the requests looked up.
    pub num_queried_tokens: u64,
    /// Tokens served from the cache.
    pub num_hit_tokens: u64,
}

impl PrefixCacheStats {
    /// Hit tokens over queried tokens; 0 before any query.
    pub fn hit_rate(&self) -> f64 {
        if self.num_queried_tokens == 0 {
            return 0.0;
        }
        self.num_hit_tokens as f64 / self.num_queried_tokens as f64
    }
}

/// Owns the block pool and every request's block table; see the module docs.
#[derive(Debug)]
pub struct KVCacheManager {
    block_size: usize,
    enable_caching: bool,
    pool: BlockPool,
    /// Block table of each request slot.
    req_blocks: Vec<Vec<BlockId>>,
    /// Leading blocks of each table already offered to the cache.
    num_registered: Vec<usize>,
    /// Every layer's attention window, when all layers slide.
    sliding_window: Option<usize>,
    /// Leading blocks of each table already freed as outside the window (now the null block).
    num_skipped: Vec<usize>,
    stats: PrefixCacheStats,
}

impl KVCacheManager {
    /// A manager over `cfg.num_blocks` blocks (the null block included) of `cfg.block_size`
    /// tokens. A `block_size` of 0 is treated as 1; the config's validation refuses it earlier.
    pub fn new(cfg: &CacheConfig) -> Self {
        Self {
            block_size: cfg.block_size.max(1),
            enable_caching: cfg.enable_prefix_caching,
            pool: BlockPool::new(cfg.num_blocks, cfg.enable_prefix_caching),
            req_blocks: Vec::new(),
            num_registered: Vec::new(),
            sliding_window: cfg.sliding_window,
            num_skipped: Vec::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks on the free list, cached ones included.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Fraction of the non-null blocks held by requests.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// The underlying pool, for reads (reference counts, cached hashes).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Prefix-cache lookups so far.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Longest cached prefix of full blocks, never the whole request: (blocks, num tokens).
    ///
    /// Hashes the request's new full blocks, then follows its hashes through the cache while they
    /// hit, over at most `(num_tokens - 1) / block_size` blocks so the last token is always
    /// recomputed for its logits. Returns nothing when caching is off or the request wants prompt
    /// logprobs. Takes no references: pass the result to [`allocate_slots`](Self::allocate_slots)
    /// before any other allocation, which could evict the returned free blocks.
    pub fn get_computed_blocks(&mut self, req: &mut Request) -> (Vec<BlockId>, usize) {
        if !self.enable_caching || req.sampling.prompt_logprobs.is_some() {
            return (Vec::new(), 0);
        }
        extend_block_hashes(req, self.block_size);
        let max_blocks = req.num_tokens().saturating_sub(1) / self.block_size;
        let hits: Vec<BlockId> =
            req.block_hashes.iter().take(max_blocks).map_while(|h| self.pool.get_cached_block(h)).collect();
        let num_hit_tokens = hits.len() * self.block_size;
        self.stats.num_requests += 1;
        self.stats.num_queried_tokens += req.num_tokens() as u64;
        self.stats.num_hit_tokens += num_hit_tokens as u64;
        (hits, num_hit_tokens)
    }

    /// Takes the computed blocks and enough new blocks for `num_new_tokens` more tokens;
    /// returns every block id appended to the request's table, or `None` when out of blocks.
    ///
    /// The request's table must end up covering `req.num_computed_tokens +
    /// num_new_computed_tokens + num_new_tokens` tokens. On `None` nothing has changed. On success
    /// the computed blocks (from [`get_computed_blocks`](Self::get_computed_blocks)) are
    /// referenced, new blocks are appended after them, and, with caching on, every full block
    /// not yet registered is offered to the cache.
    pub fn allocate_slots(
        &mut self,
        idx: ReqIdx,
        req: &mut Request,
        num_new_tokens: usize,
        new_computed_blocks: &[BlockId],
        num_new_computed_tokens: usize,
    ) -> Option<Vec<BlockId>> {
        self.remove_skipped_blocks(idx, req.num_computed_tokens);
        let total = req.num_computed_tokens + num_new_computed_tokens + num_new_tokens;
        let num_held = self.req_blocks.get(idx).map_or(0, Vec::len) + new_computed_blocks.len();
        let num_new_blocks = total.div_ceil(self.block_size).saturating_sub(num_held);
        // Computed blocks nobody holds sit on the free list; touching them takes them off it.
        let num_revived = new_computed_blocks.iter().filter(|&&b| self.pool.ref_cnt(b) == 0).count();
        if num_new_blocks + num_revived > self.pool.num_free_blocks() {
            return None;
        }
        self.pool.touch(new_computed_blocks);
        // Cannot fail: the check above left room for these after the touch.
        let new_blocks = self.pool.get_new_blocks(num_new_blocks)?;
        if idx >= self.req_blocks.len() {
            self.req_blocks.resize_with(idx + 1, Vec::new);
            self.num_registered.resize(idx + 1, 0);
            self.num_skipped.resize(idx + 1, 0);
        }
        let mut appended = Vec::with_capacity(new_computed_blocks.len() + new_blocks.len());
        appended.extend_from_slice(new_computed_blocks);
        appended.extend_from_slice(&new_blocks);
        self.req_blocks[idx].extend_from_slice(&appended);
        if self.enable_caching {
            self.register_full_blocks(idx, req, total.min(req.num_tokens()) / self.block_size);
        }
        Some(appended)
    }

    /// Offers the request's blocks `[registered, num_full)` to the cache under their hashes.
    fn register_full_blocks(&mut self, idx: ReqIdx, req: &mut Request, num_full: usize) {
        let start = self.num_registered[idx];
        if num_full <= start {
            return;
        }
        if req.block_hashes.len() < num_full {
            extend_block_hashes(req, self.block_size);
        }
        let end = num_full.min(req.block_hashes.len()).min(self.req_blocks[idx].len());
        if end <= start {
            return;
        }
        self.pool.cache_full_blocks(&self.req_blocks[idx][start..end], &req.block_hashes[start..end]);
        self.num_registered[idx] = end;
    }

    /// Releases the request's blocks, last block first so its tail is evicted before its prefix,
    /// and empties its table. Unknown slots are ignored.
    pub fn free(&mut self, idx: ReqIdx) {
        if let Some(table) = self.req_blocks.get_mut(idx) {
            self.pool.free_blocks(table.drain(..).rev());
            self.num_registered[idx] = 0;
            self.num_skipped[idx] = 0;
        }
    }

    /// With a sliding window on every layer, frees the request's blocks whose tokens all lie
    /// before `num_computed_tokens - window`: no query at or after `num_computed_tokens` can
    /// attend to them. Their table slots become the null block, so every position keeps its
    /// block index. Amortized O(1) per block over a request's life.
    pub fn remove_skipped_blocks(&mut self, idx: ReqIdx, num_computed_tokens: usize) {
        let Some(window) = self.sliding_window else { return };
        let Some(table) = self.req_blocks.get_mut(idx) else { return };
        let start = self.num_skipped[idx];
        let end = (num_computed_tokens.saturating_sub(window) / self.block_size).min(table.len());
        if end <= start {
            return;
        }
        // Oldest last, so the pool evicts the oldest of them last.
        let freed: Vec<BlockId> = table[start..end].iter().rev().copied().collect();
        table[start..end].fill(NULL_BLOCK);
        self.pool.free_blocks(freed);
        self.num_skipped[idx] = end;
    }

    /// The request's block table; empty for a slot that holds nothing.
    pub fn block_ids(&self, idx: ReqIdx) -> &[BlockId] {
        self.req_blocks.get(idx).map_or(&[], Vec::as_slice)
    }

    /// Forgets every cached block. Refused (`false`) while any request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Checks the pool's invariants and the module's; the error names the broken one.
    /// O(num_blocks + total table length).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let num_blocks = self.pool.num_blocks();
        let mut refs = vec![0u32; num_blocks];
        // Slot index + 1 of the last table seen holding each block, to find duplicates in O(1).
        let mut last_seen = vec![0usize; num_blocks];
        for (idx, table) in self.req_blocks.iter().enumerate() {
            for (pos, &b) in table.iter().enumerate() {
                let i = b as usize;
                // Only the slots freed as outside the sliding window may hold the null block.
                if b == NULL_BLOCK && pos < self.num_skipped[idx] {
                    continue;
                }
                if b == NULL_BLOCK || i >= num_blocks {
                    return Err(format!("request {idx} holds invalid block {b}"));
                }
                if last_seen[i] == idx + 1 {
                    return Err(format!("request {idx} holds block {b} twice"));
                }
                last_seen[i] = idx + 1;
                refs[i] += 1;
            }
            if self.num_registered[idx] > table.len() {
                return Err(format!("request {idx} registered more blocks than it holds"));
            }
        }
        for (b, &n) in refs.iter().enumerate().skip(1) {
            let rc = self.pool.ref_cnt(b as BlockId);
            if rc != n {
                return Err(format!("block {b} has ref_cnt {rc} but {n} tables hold it"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::hashing::MultiModalFeature;
    use crate::request::{EngineRequest, SamplingOptions, TokenId};

    const BS: usize = 4;

    fn manager(num_blocks: usize, caching: bool) -> KVCacheManager {
        let cfg =
            CacheConfig { block_size: BS, num_blocks, enable_prefix_caching: caching, sliding_window: None };
        KVCacheManager::new(&cfg)
    }

    fn request(tokens: Vec<TokenId>) -> Request {
        Request::new(EngineRequest::new("r", tokens, SamplingOptions::default()), 0, 1 << 20)
    }

    /// Looks up, allocates the whole prompt and marks it computed, as the scheduler would.
    fn admit(m: &mut KVCacheManager, idx: ReqIdx, req: &mut Request) -> Option<(Vec<BlockId>, usize)> {
        let (hits, num_hit) = m.get_computed_blocks(req);
        let num_new = req.num_tokens() - num_hit;
        m.allocate_slots(idx, req, num_new, &hits, num_hit)?;
        req.num_computed_tokens = req.num_tokens();
        m.check_invariants().unwrap();
        Some((hits, num_hit))
    }

    #[test]
    fn allocates_ceil_of_tokens_over_block_size() {
        let mut m = manager(10, true);
        let mut r = request((0..9).collect());
        let got = m.allocate_slots(0, &mut r, 9, &[], 0).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(m.block_ids(0), got.as_slice());
        assert_eq!(m.allocate_slots(0, &mut r, 0, &[], 0), Some(vec![]));
        m.check_invariants().unwrap();
    }

    #[test]
    fn decode_allocates_only_when_block_fills() {
        let mut m = manager(10, true);
        let mut r = request((0..7).collect());
        admit(&mut m, 0, &mut r).unwrap();
        r.all_token_ids.push(7);
        assert_eq!(m.allocate_slots(0, &mut r, 1, &[], 0), Some(vec![]));
        r.num_computed_tokens += 1;
        r.all_token_ids.push(8);
        assert_eq!(m.allocate_slots(0, &mut r, 1, &[], 0).map(|v| v.len()), Some(1));
        assert_eq!(m.block_ids(0).len(), 3);
        m.check_invariants().unwrap();
    }

    #[test]
    fn finished_prefix_is_reused_by_next_request() {
        let mut m = manager(10, true);
        let mut a = request((0..10).collect());
        admit(&mut m, 0, &mut a).unwrap();
        let a_blocks = m.block_ids(0).to_vec();
        m.free(0);
        let mut b = request((0..10).collect());
        let (hits, num_hit) = admit(&mut m, 1, &mut b).unwrap();
        assert_eq!(hits, a_blocks[..2].to_vec());
        assert_eq!(num_hit, 8);
        let stats = m.prefix_cache_stats();
        assert_eq!((stats.num_requests, stats.num_queried_tokens, stats.num_hit_tokens), (2, 20, 8));
    }

    #[test]
    fn lookup_never_covers_whole_prompt() {
        let mut m = manager(10, true);
        let mut a = request((0..8).collect());
        admit(&mut m, 0, &mut a).unwrap();
        let mut b = request((0..8).collect());
        let (hits, num_hit) = m.get_computed_blocks(&mut b);
        assert_eq!((hits.len(), num_hit), (1, 4), "the last token must be recomputed");
    }

    #[test]
    fn shared_prefix_blocks_are_ref_counted_twice() {
        let mut m = manager(10, true);
        let mut a = request((0..9).collect());
        admit(&mut m, 0, &mut a).unwrap();
        let mut b = request((0..8).chain([100, 101]).collect());
        let (hits, _) = admit(&mut m, 1, &mut b).unwrap();
        assert_eq!(hits.len(), 2);
        for &blk in &hits {
            assert_eq!(m.pool().ref_cnt(blk), 2);
        }
        m.free(0);
        for &blk in &hits {
            assert_eq!(m.pool().ref_cnt(blk), 1);
        }
        m.free(1);
        assert_eq!(m.num_free_blocks(), 9);
        m.check_invariants().unwrap();
    }

    #[test]
    fn cache_salt_separates_prefixes() {
        let mut m = manager(10, true);
        let mut a = request((0..9).collect());
        a.cache_salt = Some("a".into());
        admit(&mut m, 0, &mut a).unwrap();
        let mut b = request((0..9).collect());
        b.cache_salt = Some("b".into());
        assert_eq!(m.get_computed_blocks(&mut b).1, 0);
        let mut c = request((0..9).collect());
        c.cache_salt = Some("a".into());
        assert_eq!(m.get_computed_blocks(&mut c).1, 8);
    }

    #[test]
    fn mm_identifier_changes_block_hash() {
        let mut m = manager(10, true);
        let image = |id: &str| vec![MultiModalFeature { identifier: id.into(), offset: 2, length: 4 }];
        let mut a = request((0..9).collect());
        a.mm_features = image("cat");
        admit(&mut m, 0, &mut a).unwrap();
        let mut b = request((0..9).collect());
        b.mm_features = image("dog");
        assert_eq!(m.get_computed_blocks(&mut b).1, 0);
        let mut c = request((0..9).collect());
        c.mm_features = image("cat");
        assert_eq!(m.get_computed_blocks(&mut c).1, 8);
    }

    #[test]
    fn prompt_logprobs_skip_the_cache() {
        let mut m = manager(10, true);
        let mut a = request((0..9).collect());
        admit(&mut m, 0, &mut a).unwrap();
        let mut b = request((0..9).collect());
        b.sampling.prompt_logprobs = Some(1);
        assert_eq!(m.get_computed_blocks(&mut b), (vec![], 0));
    }

    #[test]
    fn caching_disabled_never_hits() {
        let mut m = manager(10, false);
        let mut a = request((0..9).collect());
        admit(&mut m, 0, &mut a).unwrap();
        m.free(0);
        let mut b = request((0..9).collect());
        assert_eq!(m.get_computed_blocks(&mut b), (vec![], 0));
        assert_eq!(m.pool().num_cached_blocks(), 0);
    }

    #[test]
    fn failed_allocation_changes_nothing() {
        let mut m = manager(5, true);
        let mut a = request((0..8).collect());
        admit(&mut m, 0, &mut a).unwrap();
        m.free(0);
        // Two cached free blocks and two plain free blocks; b hits one and needs four more.
        let mut b = request((0..4).chain(50..66).collect());
        let (hits, num_hit) = m.get_computed_blocks(&mut b);
        assert_eq!(hits.len(), 1);
        let before = (m.num_free_blocks(), m.pool().num_cached_blocks(), m.pool().ref_cnt(hits[0]));
        assert_eq!(m.allocate_slots(1, &mut b, 16, &hits, num_hit), None);
        let after = (m.num_free_blocks(), m.pool().num_cached_blocks(), m.pool().ref_cnt(hits[0]));
        assert_eq!(before, after);
        assert!(m.block_ids(1).is_empty());
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_computed_hits_count_against_free_blocks() {
        let mut m = manager(4, true);
        let mut a = request((0..8).collect());
        admit(&mut m, 0, &mut a).unwrap();
        m.free(0);
        // 3 free blocks, 2 of them the hits: 2 + 2 new blocks do not fit, 2 + 1 do.
        let mut b = request((0..8).chain(20..28).collect());
        let (hits, num_hit) = m.get_computed_blocks(&mut b);
        assert_eq!(hits.len(), 2);
        assert_eq!(m.allocate_slots(1, &mut b, 8, &hits, num_hit), None);
        assert_eq!(m.allocate_slots(1, &mut b, 4, &hits, num_hit).map(|v| v.len()), Some(3));
        m.check_invariants().unwrap();
    }

    #[test]
    fn free_evicts_request_tail_first() {
        let mut m = manager(4, true);
        let mut a = request((0..12).collect());
        admit(&mut m, 0, &mut a).unwrap();
        let table = m.block_ids(0).to_vec();
        m.free(0);
        let mut other = request((100..104).collect());
        let got = m.allocate_slots(1, &mut other, 4, &[], 0).unwrap();
        assert_eq!(got, vec![table[2]]);
        let mut again = request((0..12).collect());
        assert_eq!(m.get_computed_blocks(&mut again).1, 8, "the prefix must survive");
    }

    #[test]
    fn reset_refused_while_blocks_in_use() {
        let mut m = manager(10, true);
        let mut a = request((0..9).collect());
        admit(&mut m, 0, &mut a).unwrap();
        assert!(!m.reset_prefix_cache());
        m.free(0);
        assert!(m.reset_prefix_cache());
        let mut b = request((0..9).collect());
        assert_eq!(m.get_computed_blocks(&mut b).1, 0);
        m.check_invariants().unwrap();
    }

    #[test]
    fn output_tokens_fill_cacheable_blocks() {
        let mut m = manager(10, true);
        let mut a = request((0..3).collect());
        admit(&mut m, 0, &mut a).unwrap();
        for t in 3..9 {
            a.all_token_ids.push(t);
            m.allocate_slots(0, &mut a, 1, &[], 0).unwrap();
            a.num_computed_tokens += 1;
        }
        m.free(0);
        let mut b = request((0..9).collect());
        assert_eq!(m.get_computed_blocks(&mut b).1, 8);
    }

    #[test]
    fn unknown_slot_is_empty_and_free_is_harmless() {
        let mut m = manager(4, true);
        assert!(m.block_ids(7).is_empty());
        m.free(7);
        m.check_invariants().unwrap();
    }
}
