//! The multimodal input cache: processed multimodal items (an image's pixel values, its grid,
//! whatever the frontend's processor made) kept by content hash, so a repeated item skips
//! preprocessing.
//!
//! The cache holds opaque byte buffers plus a small metadata string the frontend writes and reads
//! back (shapes, dtypes); it never looks inside either. It is bounded by bytes, not entries: an
//! entry costs its buffer, its metadata and its key.
//!
//! Invariants: `num_bytes` is the sum of the live entries' costs and never exceeds `capacity`
//! after a call returns; an entry larger than the whole capacity is not stored (and nothing is
//! evicted for it); a capacity of 0 stores nothing. `get` and `put` refresh an entry's recency;
//! eviction takes the least recently used first.
//!
//! Costs: `get` and `put` are O(log n) (a hash map for lookup and an ordered map of recency ticks
//! for eviction); `put` copies nothing beyond taking ownership of the buffer it is given.

use std::collections::{BTreeMap, HashMap};

/// Counters of a [`MultiModalCache`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MultiModalCacheStats {
    pub num_hits: u64,
    pub num_misses: u64,
    pub num_evictions: u64,
    pub num_entries: usize,
    pub num_bytes: usize,
}

/// One stored item: its buffer, its metadata and the recency tick it is filed under.
#[derive(Debug)]
struct Entry {
    data: Vec<u8>,
    metadata: String,
    tick: u64,
}

impl Entry {
    fn cost(&self, key: &str) -> usize {
        self.data.len() + self.metadata.len() + key.len()
    }
}

/// A byte-bounded LRU of processed multimodal items keyed by content hash.
#[derive(Debug, Default)]
pub struct MultiModalCache {
    capacity: usize,
    entries: HashMap<String, Entry>,
    /// Recency tick -> key; the first entry is the least recently used.
    order: BTreeMap<u64, String>,
    next_tick: u64,
    stats: MultiModalCacheStats,
}

impl MultiModalCache {
    /// A cache holding at most `capacity_bytes` bytes (0 disables it).
    pub fn new(capacity_bytes: usize) -> Self {
        Self { capacity: capacity_bytes, ..Self::default() }
    }

    /// The byte bound the cache was built with.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The item stored under `key` (its buffer and metadata), counting a hit or a miss and
    /// marking it most recently used.
    pub fn get(&mut self, key: &str) -> Option<(&[u8], &str)> {
        let tick = self.bump();
        let Some(entry) = self.entries.get_mut(key) else {
            self.stats.num_misses += 1;
            return None;
        };
        self.stats.num_hits += 1;
        self.order.remove(&entry.tick);
        self.order.insert(tick, key.to_string());
        entry.tick = tick;
        Some((&entry.data, &entry.metadata))
    }

    /// Whether `key` is stored, without counting or touching recency.
    pub fn contains(&self, key: &str) -> bool {
        self.entries.contains_key(key)
    }

    /// Stores an item, replacing any under the same key and evicting least recently used items
    /// until it fits. Returns whether it was stored: an item bigger than the capacity is not.
    pub fn put(&mut self, key: String, data: Vec<u8>, metadata: String) -> bool {
        self.remove(&key);
        let tick = self.bump();
        let entry = Entry { data, metadata, tick };
        let cost = entry.cost(&key);
        if cost > self.capacity {
            return false;
        }
        while self.stats.num_bytes + cost > self.capacity {
            self.evict_oldest();
        }
        self.stats.num_bytes += cost;
        self.order.insert(tick, key.clone());
        self.entries.insert(key, entry);
        self.stats.num_entries = self.entries.len();
        true
    }

    /// Drops every item; the hit, miss and eviction counters are kept.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.order.clear();
        self.stats.num_entries = 0;
        self.stats.num_bytes = 0;
    }

    /// The counters, with the current entry count and bytes.
    pub fn stats(&self) -> MultiModalCacheStats {
        self.stats
    }

    fn bump(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }

    fn remove(&mut self, key: &str) {
        if let Some(entry) = self.entries.remove(key) {
            self.order.remove(&entry.tick);
            self.stats.num_bytes -= entry.cost(key);
            self.stats.num_entries = self.entries.len();
        }
    }

    fn evict_oldest(&mut self) {
        if let Some((_, key)) = self.order.pop_first() {
            if let Some(entry) = self.entries.remove(&key) {
                self.stats.num_bytes -= entry.cost(&key);
                self.stats.num_evictions += 1;
                self.stats.num_entries = self.entries.len();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(n: usize) -> Vec<u8> {
        vec![7; n]
    }

    #[test]
    fn stored_item_comes_back_with_its_metadata() {
        let mut c = MultiModalCache::new(1000);
        assert!(c.put("a".into(), item(10), "meta".into()));
        let (data, meta) = c.get("a").unwrap();
        assert_eq!((data.len(), meta), (10, "meta"));
        assert_eq!(c.stats().num_hits, 1);
    }

    #[test]
    fn missing_key_counts_a_miss() {
        let mut c = MultiModalCache::new(1000);
        assert!(c.get("x").is_none());
        assert_eq!(c.stats().num_misses, 1);
    }

    #[test]
    fn evicts_least_recently_used_first() {
        // Each entry costs 100 + 1 (key) bytes: three fit in 303.
        let mut c = MultiModalCache::new(303);
        c.put("a".into(), item(100), String::new());
        c.put("b".into(), item(100), String::new());
        c.put("c".into(), item(100), String::new());
        c.get("a");
        c.put("d".into(), item(100), String::new());
        assert!(c.contains("a") && c.contains("c") && c.contains("d"));
        assert!(!c.contains("b"), "b was the least recently used");
        assert_eq!(c.stats().num_evictions, 1);
    }

    #[test]
    fn bytes_never_exceed_capacity() {
        let mut c = MultiModalCache::new(500);
        for i in 0..50 {
            c.put(format!("k{i}"), item(37 + i * 3), "m".into());
            assert!(c.stats().num_bytes <= 500, "{:?}", c.stats());
        }
    }

    #[test]
    fn item_larger_than_capacity_is_refused_without_evicting() {
        let mut c = MultiModalCache::new(100);
        c.put("a".into(), item(50), String::new());
        assert!(!c.put("big".into(), item(200), String::new()));
        assert!(c.contains("a"));
        assert_eq!(c.stats().num_evictions, 0);
    }

    #[test]
    fn zero_capacity_stores_nothing() {
        let mut c = MultiModalCache::new(0);
        assert!(!c.put("a".into(), Vec::new(), String::new()));
        assert_eq!(c.stats().num_entries, 0);
    }

    #[test]
    fn replacing_a_key_updates_its_bytes() {
        let mut c = MultiModalCache::new(1000);
        c.put("a".into(), item(100), String::new());
        c.put("a".into(), item(10), String::new());
        assert_eq!(c.stats().num_bytes, 11);
        assert_eq!(c.stats().num_entries, 1);
    }

    #[test]
    fn clear_keeps_counters() {
        let mut c = MultiModalCache::new(1000);
        c.put("a".into(), item(10), String::new());
        c.get("a");
        c.clear();
        assert_eq!(c.stats().num_bytes, 0);
        assert_eq!(c.stats().num_hits, 1);
        assert!(c.get("a").is_none());
    }
}
