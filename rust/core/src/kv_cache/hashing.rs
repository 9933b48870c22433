//! Content hashes of full KV blocks, the keys of the prefix cache.
//!
//! A block's hash covers its parent's hash, its token ids and its extra keys (the multimodal items
//! it overlaps, and the request's cache salt for the first block), so two blocks share a hash only
//! when the whole token prefix up to and including them matches, under the same salt and with the
//! same multimodal content.
//!
//! Invariants: every field fed to the hasher is tagged or length-prefixed, so no two different
//! (parent, tokens, extra keys) triples serialise to the same bytes; `req.block_hashes[i]` is the
//! hash of block `i` of `req.all_token_ids`, and only full blocks are hashed.
//!
//! Costs: one streaming xxh3-128 pass over `16 + 4 * block_size` bytes plus the extra keys per
//! block; [`extend_block_hashes`] hashes only blocks not hashed before, so over a request's life
//! each block is hashed once.

use xxhash_rust::xxh3::Xxh3Default;

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

/// Stands in for the parent hash of a request's first block.
const ROOT_MARKER: &[u8; 8] = b"ferroKV0";
/// Tags a multimodal identifier among a block's extra keys.
const MM_TAG: &[u8] = b"mm";
/// Tags a cache salt among a block's extra keys.
const SALT_TAG: &[u8] = b"salt";
/// Tokens serialised per hasher update; keeps the scratch buffer on the stack.
const TOKENS_PER_CHUNK: usize = 64;

/// Hashes one full block: `parent` is the previous block's hash (`None` for a request's first
/// block), `tokens` the block's token ids and `extra_keys` any further byte strings that must
/// separate otherwise equal blocks. Computes xxh3-128 over a tagged, length-prefixed encoding.
pub fn hash_block_tokens(parent: Option<BlockHash>, tokens: &[TokenId], extra_keys: &[&[u8]]) -> BlockHash {
    let mut h = Xxh3Default::new();
    match parent {
        Some(BlockHash(p)) => {
            h.update(&[1]);
            h.update(&p.to_le_bytes());
        }
        None => {
            h.update(&[0]);
            h.update(ROOT_MARKER);
        }
    }
    h.update(&(tokens.len() as u64).to_le_bytes());
    let mut buf = [0u8; 4 * TOKENS_PER_CHUNK];
    for chunk in tokens.chunks(TOKENS_PER_CHUNK) {
        for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        h.update(&buf[..4 * chunk.len()]);
    }
    h.update(&(extra_keys.len() as u64).to_le_bytes());
    for key in extra_keys {
        h.update(&(key.len() as u64).to_le_bytes());
        h.update(key);
    }
    BlockHash(h.digest128())
}

/// Extends `req.block_hashes` to cover every full block of `req.all_token_ids` (prompt and output
/// tokens alike), hashing only the blocks not hashed yet. A `block_size` of 0 does nothing.
pub fn extend_block_hashes(req: &mut Request, block_size: usize) {
    if block_size == 0 {
        return;
    }
    let num_full = req.all_token_ids.len() / block_size;
    let mut keys: Vec<&[u8]> = Vec::new();
    for i in req.block_hashes.len()..num_full {
        let (start, end) = (i * block_size, (i + 1) * block_size);
        keys.clear();
        for f in &req.mm_features {
            if f.offset < end && f.offset.saturating_add(f.length) > start {
                keys.push(MM_TAG);
                keys.push(f.identifier.as_bytes());
            }
        }
        if i == 0 {
            if let Some(salt) = &req.cache_salt {
                keys.push(SALT_TAG);
                keys.push(salt.as_bytes());
            }
        }
        let parent = req.block_hashes.last().copied();
        let hash = hash_block_tokens(parent, &req.all_token_ids[start..end], &keys);
        req.block_hashes.push(hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::{EngineRequest, SamplingOptions};

    fn request(tokens: Vec<TokenId>) -> Request {
        Request::new(EngineRequest::new("r", tokens, SamplingOptions::default()), 0, 1 << 20)
    }

    #[test]
    fn equal_inputs_hash_equal() {
        let a = hash_block_tokens(None, &[1, 2, 3], &[b"x"]);
        let b = hash_block_tokens(None, &[1, 2, 3], &[b"x"]);
        assert_eq!(a, b);
    }

    #[test]
    fn parent_changes_block_hash() {
        let root = hash_block_tokens(None, &[1, 2], &[]);
        let child = hash_block_tokens(Some(root), &[3, 4], &[]);
        assert_ne!(child, hash_block_tokens(None, &[3, 4], &[]));
        assert_ne!(child, hash_block_tokens(Some(BlockHash(root.0 ^ 1)), &[3, 4], &[]));
    }

    #[test]
    fn extra_key_splits_do_not_collide() {
        let joined = hash_block_tokens(None, &[1], &[b"ab"]);
        let split = hash_block_tokens(None, &[1], &[b"a", b"b"]);
        let empty = hash_block_tokens(None, &[1], &[b"", b"ab"]);
        assert_ne!(joined, split);
        assert_ne!(joined, empty);
        assert_ne!(hash_block_tokens(None, &[1], &[]), hash_block_tokens(None, &[1], &[b""]));
    }

    #[test]
    fn long_blocks_hash_every_token() {
        let a: Vec<TokenId> = (0..200).collect();
        let mut b = a.clone();
        b[199] = 7;
        assert_ne!(hash_block_tokens(None, &a, &[]), hash_block_tokens(None, &b, &[]));
    }

    #[test]
    fn hashes_cover_only_full_blocks() {
        let mut r = request((0..10).collect());
        extend_block_hashes(&mut r, 4);
        assert_eq!(r.block_hashes.len(), 2);
        let first = hash_block_tokens(None, &[0, 1, 2, 3], &[]);
        assert_eq!(r.block_hashes[0], first);
        assert_eq!(r.block_hashes[1], hash_block_tokens(Some(first), &[4, 5, 6, 7], &[]));
    }

    #[test]
    fn extending_hashes_only_new_blocks() {
        let mut r = request((0..6).collect());
        extend_block_hashes(&mut r, 4);
        let kept = r.block_hashes[0];
        r.block_hashes[0] = BlockHash(42);
        r.all_token_ids.extend([6, 7, 8, 9]);
        extend_block_hashes(&mut r, 4);
        assert_eq!(r.block_hashes.len(), 2);
        assert_eq!(r.block_hashes[0], BlockHash(42), "an existing hash was recomputed");
        assert_eq!(r.block_hashes[1], hash_block_tokens(Some(BlockHash(42)), &[4, 5, 6, 7], &[]));
        assert_ne!(kept, BlockHash(42));
    }

    #[test]
    fn cache_salt_separates_prefixes() {
        let mut plain = request((0..8).collect());
        let mut salted = request((0..8).collect());
        salted.cache_salt = Some("tenant-a".into());
        extend_block_hashes(&mut plain, 4);
        extend_block_hashes(&mut salted, 4);
        assert_ne!(plain.block_hashes[0], salted.block_hashes[0]);
        assert_ne!(plain.block_hashes[1], salted.block_hashes[1], "salt must chain to later blocks");
    }

    #[test]
    fn salt_and_mm_identifier_do_not_collide() {
        let mut salted = request((0..4).collect());
        salted.cache_salt = Some("x".into());
        let mut with_mm = request((0..4).collect());
        with_mm.mm_features = vec![MultiModalFeature { identifier: "x".into(), offset: 0, length: 2 }];
        extend_block_hashes(&mut salted, 4);
        extend_block_hashes(&mut with_mm, 4);
        assert_ne!(salted.block_hashes[0], with_mm.block_hashes[0]);
    }

    #[test]
    fn mm_identifier_changes_block_hash() {
        let feature = |id: &str| MultiModalFeature { identifier: id.into(), offset: 3, length: 3 };
        let mut a = request((0..12).collect());
        let mut b = request((0..12).collect());
        a.mm_features = vec![feature("img-a")];
        b.mm_features = vec![feature("img-b")];
        let mut plain = request((0..12).collect());
        extend_block_hashes(&mut a, 4);
        extend_block_hashes(&mut b, 4);
        extend_block_hashes(&mut plain, 4);
        // The item spans positions 3..6: blocks 0 and 1 carry it, block 2 only through chaining.
        assert_ne!(a.block_hashes[0], b.block_hashes[0]);
        assert_ne!(a.block_hashes[1], b.block_hashes[1]);
        assert_ne!(a.block_hashes[0], plain.block_hashes[0]);
        let tokens: Vec<TokenId> = (8..12).collect();
        assert_eq!(a.block_hashes[2], hash_block_tokens(Some(a.block_hashes[1]), &tokens, &[]));
    }

    #[test]
    fn mm_item_outside_block_leaves_hash_alone() {
        let mut a = request((0..8).collect());
        a.mm_features = vec![MultiModalFeature { identifier: "img".into(), offset: 4, length: 4 }];
        let mut plain = request((0..8).collect());
        extend_block_hashes(&mut a, 4);
        extend_block_hashes(&mut plain, 4);
        assert_eq!(a.block_hashes[0], plain.block_hashes[0]);
        assert_ne!(a.block_hashes[1], plain.block_hashes[1]);
    }
}
