//! The pool of physical KV blocks: reference counts, the free list and the prefix-cache map.
//!
//! Blocks live in one `Vec`; block 0 is the reserved null block ([`NULL_BLOCK`]), never handed
//! out and never freed. Every other block with `ref_cnt == 0` sits on a doubly linked free list
//! threaded through the blocks themselves by `u32` indices. Allocation pops from the head, freeing
//! appends to the tail, so free blocks are evicted in the order they were freed (least recently
//! used first). A freed block keeps its hash and stays findable by prefix lookups until it is
//! popped for reuse; a lookup hit on a free block unlinks it from the middle of the list.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]): a non-null block is on the free list
//! exactly when its `ref_cnt` is 0; the list's length is `num_free`; every entry of the cached map
//! points to a block carrying that hash, and every block carrying a hash is that hash's entry.
//!
//! Costs: allocate, touch and free are O(1) per block with no allocation beyond the returned
//! `Vec`; a cache lookup is one hash-map probe; `reset_prefix_cache` is O(num_blocks).

use std::collections::HashMap;

use super::hashing::BlockHash;

/// Index of a physical KV block.
pub type BlockId = u32;
/// The reserved block that pads block tables; never allocated, never freed.
pub const NULL_BLOCK: BlockId = 0;

/// Marks the end of the free list.
const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    prev_free: u32,
    next_free: u32,
}

/// Owns every block's metadata and hands out block ids; see the module docs.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free_head: u32,
    free_tail: u32,
    num_free: usize,
    enable_caching: bool,
    cached: HashMap<BlockHash, BlockId>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks including the null block (at least one block is kept), all
    /// free. With `enable_caching` off, [`cache_full_blocks`](Self::cache_full_blocks) is a no-op.
    ///
    /// # Panics
    /// If `num_blocks` does not fit a `u32` block id.
    pub fn new(num_blocks: usize, enable_caching: bool) -> Self {
        let num_blocks = num_blocks.max(1);
        assert!(num_blocks < NIL as usize, "num_blocks {num_blocks} exceeds the u32 block id range");
        let blocks = (0..num_blocks as u32)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev_free: if i <= 1 { NIL } else { i - 1 },
                next_free: if i == 0 || i + 1 == num_blocks as u32 { NIL } else { i + 1 },
            })
            .collect();
        let has_free = num_blocks > 1;
        Self {
            blocks,
            free_head: if has_free { 1 } else { NIL },
            free_tail: if has_free { num_blocks as u32 - 1 } else { NIL },
            num_free: num_blocks - 1,
            enable_caching,
            cached: HashMap::new(),
        }
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks on the free list (including freed blocks still cached).
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Whether full blocks are registered for prefix reuse.
    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    /// Fraction of the non-null blocks currently held by requests, in `[0, 1]`.
    pub fn usage(&self) -> f64 {
        let usable = self.blocks.len() - 1;
        if usable == 0 {
            return 0.0;
        }
        1.0 - self.num_free as f64 / usable as f64
    }

    /// References held on `id`. Panics if `id` is out of range.
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    /// The hash `id` is cached under, if any. Panics if `id` is out of range.
    pub fn block_hash(&self, id: BlockId) -> Option<BlockHash> {
        self.blocks[id as usize].hash
    }

    /// Number of blocks currently findable by hash.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// The block cached under `h`, whether in use or free.
    pub fn get_cached_block(&self, h: &BlockHash) -> Option<BlockId> {
        self.cached.get(h).copied()
    }

    /// Takes `n` blocks from the head of the free list, each with `ref_cnt` 1, evicting any hash
    /// they carried. Returns `None`, taking nothing, when fewer than `n` blocks are free.
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.free_head;
            self.unlink(id);
            self.evict(id);
            self.blocks[id as usize].ref_cnt = 1;
            out.push(id);
        }
        Some(out)
    }

    /// Takes one more reference on each block, unlinking free ones (prefix hits) from the free
    /// list. The null block is ignored. Panics if an id is out of range.
    pub fn touch(&mut self, ids: &[BlockId]) {
        for &id in ids {
            if id == NULL_BLOCK {
                continue;
            }
            if self.blocks[id as usize].ref_cnt == 0 {
                self.unlink(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Drops one reference on each block, in the given order; a block reaching 0 goes to the tail
    /// of the free list, keeping its hash. The null block is ignored, and so is a block already at
    /// 0 (a caller bug that debug builds report by panicking). Panics if an id is out of range.
    pub fn free_blocks(&mut self, ids: impl IntoIterator<Item = BlockId>) {
        for id in ids {
            let block = &mut self.blocks[id as usize];
            if id == NULL_BLOCK || block.ref_cnt == 0 {
                debug_assert!(id == NULL_BLOCK, "double free of block {id}");
                continue;
            }
            block.ref_cnt -= 1;
            if block.ref_cnt == 0 {
                self.push_tail(id);
            }
        }
    }

    /// Registers `blocks[i]` under `hashes[i]` for prefix reuse (pairs beyond the shorter slice are
    /// ignored). A block that already carries a hash, or whose hash another block already holds,
    /// is left as it is. Does nothing when caching is disabled.
    pub fn cache_full_blocks(&mut self, blocks: &[BlockId], hashes: &[BlockHash]) {
        if !self.enable_caching {
            return;
        }
        for (&id, &h) in blocks.iter().zip(hashes) {
            if id == NULL_BLOCK || self.blocks[id as usize].hash.is_some() {
                continue;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
                e.insert(id);
                self.blocks[id as usize].hash = Some(h);
            }
        }
    }

    /// Forgets every cached hash. Refused (returns `false`, changing nothing) while any block is
    /// held by a request; returns `true` once the cache is empty.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.num_free != self.blocks.len() - 1 {
            return false;
        }
        self.cached.clear();
        for b in &mut self.blocks {
            b.hash = None;
        }
        true
    }

    /// Checks the module's invariants; the error says which one broke. O(num_blocks).
    pub fn check_invariants(&self) -> Result<(), String> {
        self.check_free_list()?;
        self.check_cached_map()
    }

    fn check_free_list(&self) -> Result<(), String> {
        let mut on_list = vec![false; self.blocks.len()];
        let (mut prev, mut cur, mut len) = (NIL, self.free_head, 0usize);
        while cur != NIL {
            let i = cur as usize;
            if cur == NULL_BLOCK || i >= self.blocks.len() {
                return Err(format!("free list holds invalid block {cur}"));
            }
            if std::mem::replace(&mut on_list[i], true) {
                return Err(format!("block {cur} is on the free list twice"));
            }
            let b = &self.blocks[i];
            if b.ref_cnt != 0 {
                return Err(format!("free block {cur} has ref_cnt {}", b.ref_cnt));
            }
            if b.prev_free != prev {
                return Err(format!("block {cur} prev_free {} != {prev}", b.prev_free));
            }
            (prev, cur, len) = (cur, b.next_free, len + 1);
        }
        if prev != self.free_tail {
            return Err(format!("free list ends at {prev}, tail is {}", self.free_tail));
        }
        if len != self.num_free {
            return Err(format!("free list length {len} != num_free {}", self.num_free));
        }
        let num_zero = self.blocks.iter().skip(1).filter(|b| b.ref_cnt == 0).count();
        if num_zero != len {
            return Err(format!("{num_zero} blocks have ref_cnt 0 but {len} are free"));
        }
        if self.blocks[NULL_BLOCK as usize].ref_cnt != 0 || self.blocks[0].hash.is_some() {
            return Err("the null block was used".into());
        }
        Ok(())
    }

    fn check_cached_map(&self) -> Result<(), String> {
        if !self.enable_caching && !self.cached.is_empty() {
            return Err("blocks cached while caching is disabled".into());
        }
        for (h, &id) in &self.cached {
            if self.blocks.get(id as usize).and_then(|b| b.hash) != Some(*h) {
                return Err(format!("cached map entry for block {id} does not match its hash"));
            }
        }
        let num_hashed = self.blocks.iter().filter(|b| b.hash.is_some()).count();
        if num_hashed != self.cached.len() {
            return Err(format!("{num_hashed} blocks carry hashes, map has {}", self.cached.len()));
        }
        Ok(())
    }

    /// Removes a free block from the list in O(1).
    fn unlink(&mut self, id: BlockId) {
        let Block { prev_free: prev, next_free: next, .. } = self.blocks[id as usize];
        match prev {
            NIL => self.free_head = next,
            p => self.blocks[p as usize].next_free = next,
        }
        match next {
            NIL => self.free_tail = prev,
            n => self.blocks[n as usize].prev_free = prev,
        }
        let b = &mut self.blocks[id as usize];
        (b.prev_free, b.next_free) = (NIL, NIL);
        self.num_free -= 1;
    }

    /// Appends a block to the tail of the free list in O(1).
    fn push_tail(&mut self, id: BlockId) {
        let tail = self.free_tail;
        let b = &mut self.blocks[id as usize];
        (b.prev_free, b.next_free) = (tail, NIL);
        match tail {
            NIL => self.free_head = id,
            t => self.blocks[t as usize].next_free = id,
        }
        self.free_tail = id;
        self.num_free += 1;
    }

    /// Drops the block's hash and its cached-map entry, if any.
    fn evict(&mut self, id: BlockId) {
        if let Some(h) = self.blocks[id as usize].hash.take() {
            // A block carries a hash only while it is that hash's entry (see cache_full_blocks).
            let owner = self.cached.remove(&h);
            debug_assert_eq!(owner, Some(id), "block {id} carried a hash it did not own");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: u128) -> BlockHash {
        BlockHash(x)
    }

    #[test]
    fn null_block_is_never_handed_out() {
        let mut pool = BlockPool::new(4, true);
        assert_eq!(pool.num_free_blocks(), 3);
        let ids = pool.get_new_blocks(3).expect("3 free blocks");
        assert!(!ids.contains(&NULL_BLOCK));
        assert_eq!(pool.get_new_blocks(1), None);
        pool.free_blocks([NULL_BLOCK]);
        assert_eq!(pool.num_free_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn short_allocation_takes_nothing() {
        let mut pool = BlockPool::new(4, true);
        assert_eq!(pool.get_new_blocks(4), None);
        assert_eq!(pool.num_free_blocks(), 3);
        assert_eq!(pool.get_new_blocks(0), Some(vec![]));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn evicts_lru_block_first() {
        let mut pool = BlockPool::new(5, true);
        let ids = pool.get_new_blocks(4).unwrap();
        pool.cache_full_blocks(&ids, &[h(1), h(2), h(3), h(4)]);
        pool.free_blocks([ids[2], ids[0], ids[3], ids[1]]);
        let first = pool.get_new_blocks(1).unwrap();
        assert_eq!(first, vec![ids[2]]);
        assert_eq!(pool.get_cached_block(&h(3)), None, "reused block must leave the cache");
        assert_eq!(pool.get_cached_block(&h(1)), Some(ids[0]));
        assert_eq!(pool.get_new_blocks(3).unwrap(), vec![ids[0], ids[3], ids[1]]);
        assert_eq!(pool.num_cached_blocks(), 0);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn freed_cached_block_stays_findable_until_reused() {
        let mut pool = BlockPool::new(3, true);
        let ids = pool.get_new_blocks(1).unwrap();
        pool.cache_full_blocks(&ids, &[h(9)]);
        pool.free_blocks(ids.iter().copied());
        assert_eq!(pool.get_cached_block(&h(9)), Some(ids[0]));
        assert_eq!(pool.block_hash(ids[0]), Some(h(9)));
        pool.check_invariants().unwrap();
    }

    #[test]
    fn touch_unlinks_free_block_from_middle() {
        let mut pool = BlockPool::new(5, true);
        let ids = pool.get_new_blocks(4).unwrap();
        pool.free_blocks(ids.iter().copied());
        pool.touch(&[ids[1]]);
        assert_eq!(pool.ref_cnt(ids[1]), 1);
        assert_eq!(pool.num_free_blocks(), 3);
        pool.check_invariants().unwrap();
        assert_eq!(pool.get_new_blocks(3).unwrap(), vec![ids[0], ids[2], ids[3]]);
        pool.touch(&[ids[1]]);
        assert_eq!(pool.ref_cnt(ids[1]), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn shared_block_is_freed_after_last_reference() {
        let mut pool = BlockPool::new(3, true);
        let ids = pool.get_new_blocks(1).unwrap();
        pool.touch(&ids);
        pool.free_blocks(ids.iter().copied());
        assert_eq!(pool.num_free_blocks(), 1);
        pool.free_blocks(ids.iter().copied());
        assert_eq!(pool.num_free_blocks(), 2);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn duplicate_hash_leaves_second_block_uncached() {
        let mut pool = BlockPool::new(4, true);
        let ids = pool.get_new_blocks(2).unwrap();
        pool.cache_full_blocks(&ids[..1], &[h(5)]);
        pool.cache_full_blocks(&ids[1..], &[h(5)]);
        assert_eq!(pool.get_cached_block(&h(5)), Some(ids[0]));
        assert_eq!(pool.block_hash(ids[1]), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn caching_disabled_caches_nothing() {
        let mut pool = BlockPool::new(4, false);
        let ids = pool.get_new_blocks(2).unwrap();
        pool.cache_full_blocks(&ids, &[h(1), h(2)]);
        assert_eq!(pool.get_cached_block(&h(1)), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn reset_refused_while_blocks_in_use() {
        let mut pool = BlockPool::new(4, true);
        let ids = pool.get_new_blocks(2).unwrap();
        pool.cache_full_blocks(&ids, &[h(1), h(2)]);
        pool.free_blocks([ids[0]]);
        assert!(!pool.reset_prefix_cache());
        assert_eq!(pool.get_cached_block(&h(1)), Some(ids[0]));
        pool.free_blocks([ids[1]]);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.num_cached_blocks(), 0);
        assert_eq!(pool.get_cached_block(&h(2)), None);
        pool.check_invariants().unwrap();
    }

    #[test]
    fn usage_counts_held_blocks() {
        let mut pool = BlockPool::new(5, true);
        assert_eq!(pool.usage(), 0.0);
        let ids = pool.get_new_blocks(2).unwrap();
        assert!((pool.usage() - 0.5).abs() < 1e-12);
        pool.free_blocks(ids);
        assert_eq!(pool.usage(), 0.0);
        assert_eq!(BlockPool::new(1, true).usage(), 0.0);
    }
}
