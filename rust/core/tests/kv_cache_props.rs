//! Property test of the KV cache manager: random admissions (prompts drawn from a few shared
//! prefixes, some salted), growth, frees and cache resets. After every operation the manager's
//! invariants hold, and a shadow copy of each block's "KV content" (which request tokens were
//! written at which slot, under which salt) proves that every prefix hit returns blocks holding
//! exactly the request's tokens. Freeing everything returns every non-null block.

use ferrollm_core::kv_cache::{BlockId, KVCacheManager};
use ferrollm_core::request::{ReqIdx, Request, TokenId};
use ferrollm_core::{CacheConfig, EngineRequest, SamplingOptions};
use proptest::prelude::*;

const BLOCK_SIZE: usize = 4;
const NUM_BLOCKS: usize = 24;
const NUM_SLOTS: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    /// Admit a request into `slot` (if empty): prefix `prefix` cut to `prefix_len`, then `suffix`.
    Allocate {
        slot: usize,
        prefix: usize,
        prefix_len: usize,
        suffix: Vec<TokenId>,
        salted: bool,
    },
    /// Append `tokens` to the request in `slot` and allocate room for them.
    Grow {
        slot: usize,
        tokens: Vec<TokenId>,
    },
    Free {
        slot: usize,
    },
    Reset,
}

fn prefixes() -> Vec<Vec<TokenId>> {
    vec![(0..24).collect(), (0..10).chain(100..114).collect(), (200..224).collect()]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..NUM_SLOTS, 0..3usize, 0..=24usize, prop::collection::vec(0..4u32, 0..10), any::<bool>())
            .prop_map(|(slot, prefix, prefix_len, suffix, salted)| Op::Allocate {
                slot, prefix, prefix_len, suffix, salted
            }),
        3 => (0..NUM_SLOTS, prop::collection::vec(0..4u32, 1..6))
            .prop_map(|(slot, tokens)| Op::Grow { slot, tokens }),
        2 => (0..NUM_SLOTS).prop_map(|slot| Op::Free { slot }),
        1 => Just(Op::Reset),
    ]
}

/// What each block slot holds: (salt, token) as written by the request that computed it.
type Content = Vec<Vec<Option<(bool, TokenId)>>>;

struct World {
    m: KVCacheManager,
    reqs: Vec<Option<Request>>,
    content: Content,
}

impl World {
    fn new() -> Self {
        let cfg = CacheConfig {
            block_size: BLOCK_SIZE,
            num_blocks: NUM_BLOCKS,
            enable_prefix_caching: true,
            sliding_window: None,
        };
        Self {
            m: KVCacheManager::new(&cfg),
            reqs: (0..NUM_SLOTS).map(|_| None).collect(),
            content: vec![vec![None; BLOCK_SIZE]; NUM_BLOCKS],
        }
    }

    fn table(&self, idx: ReqIdx) -> Vec<BlockId> {
        self.m.block_ids(idx).to_vec()
    }

    /// Writes the request's tokens in `[from, to)` into its blocks, as the model runner would.
    fn write(&mut self, idx: ReqIdx, req: &Request, from: usize, to: usize) {
        let table = self.table(idx);
        let salted = req.cache_salt.is_some();
        for pos in from..to {
            let b = table[pos / BLOCK_SIZE] as usize;
            self.content[b][pos % BLOCK_SIZE] = Some((salted, req.all_token_ids[pos]));
        }
    }

    fn allocate(&mut self, slot: usize, tokens: Vec<TokenId>, salted: bool) -> Result<(), TestCaseError> {
        if self.reqs[slot].is_some() || tokens.is_empty() {
            return Ok(());
        }
        let mut er = EngineRequest::new(format!("r{slot}"), tokens, SamplingOptions::default());
        er.cache_salt = salted.then(|| "salt".to_string());
        let mut req = Request::new(er, 0, 1 << 16);
        let (hits, num_hit) = self.m.get_computed_blocks(&mut req);
        prop_assert!(num_hit < req.num_tokens(), "lookup covered the whole prompt");
        for (pos, &t) in req.all_token_ids[..num_hit].iter().enumerate() {
            let b = hits[pos / BLOCK_SIZE] as usize;
            prop_assert_eq!(self.content[b][pos % BLOCK_SIZE], Some((salted, t)), "stale hit");
        }
        let free_before = self.m.num_free_blocks();
        let num_new = req.num_tokens() - num_hit;
        match self.m.allocate_slots(slot, &mut req, num_new, &hits, num_hit) {
            Some(_) => {
                prop_assert_eq!(self.table(slot).len(), req.num_tokens().div_ceil(BLOCK_SIZE));
                self.write(slot, &req, num_hit, req.num_tokens());
                req.num_computed_tokens = req.num_tokens();
                self.reqs[slot] = Some(req);
            }
            None => {
                prop_assert_eq!(self.m.num_free_blocks(), free_before);
                prop_assert!(self.m.block_ids(slot).is_empty());
            }
        }
        Ok(())
    }

    fn grow(&mut self, slot: usize, tokens: &[TokenId]) -> Result<(), TestCaseError> {
        let Some(mut req) = self.reqs[slot].take() else {
            return Ok(());
        };
        let before = (req.num_tokens(), self.m.num_free_blocks(), self.table(slot));
        req.all_token_ids.extend_from_slice(tokens);
        match self.m.allocate_slots(slot, &mut req, tokens.len(), &[], 0) {
            Some(_) => {
                self.write(slot, &req, before.0, req.num_tokens());
                req.num_computed_tokens = req.num_tokens();
            }
            None => {
                prop_assert_eq!(self.m.num_free_blocks(), before.1);
                prop_assert_eq!(self.table(slot), before.2);
                req.all_token_ids.truncate(before.0);
                req.block_hashes.truncate(before.0 / BLOCK_SIZE);
            }
        }
        self.reqs[slot] = Some(req);
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Allocate { slot, prefix, prefix_len, suffix, salted } => {
                let mut tokens = prefixes()[prefix][..prefix_len].to_vec();
                tokens.extend(suffix);
                self.allocate(slot, tokens, salted)?;
            }
            Op::Grow { slot, tokens } => self.grow(slot, &tokens)?,
            Op::Free { slot } => {
                self.m.free(slot);
                self.reqs[slot] = None;
            }
            Op::Reset => {
                let idle = self.m.num_free_blocks() == NUM_BLOCKS - 1;
                prop_assert_eq!(self.m.reset_prefix_cache(), idle);
            }
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_under_random_operations(ops in prop::collection::vec(op(), 1..80)) {
        let mut w = World::new();
        for op in ops {
            w.apply(op)?;
            if let Err(e) = w.m.check_invariants() {
                return Err(TestCaseError::fail(e));
            }
        }
        for slot in 0..NUM_SLOTS {
            w.m.free(slot);
        }
        w.m.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(w.m.num_free_blocks(), NUM_BLOCKS - 1);
        prop_assert!(w.m.reset_prefix_cache());
        prop_assert_eq!(w.m.pool().num_cached_blocks(), 0);
    }
}
