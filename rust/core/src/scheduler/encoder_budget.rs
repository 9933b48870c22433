//! The encoder budget (vLLM's `max_num_encoder_input_tokens`): how many multimodal items a step
//! may send through the encoder, counted in their placeholder tokens.
//!
//! A request's items are encoded in the first step that schedules any of their placeholders;
//! the runner keeps an item's encoder output until its last placeholder is computed, so a
//! chunked prefill that splits an item costs the encoder once. When the items a request's next
//! chunk would start do not fit the step's remaining encoder budget, the chunk is cut before the
//! first item that does not fit (possibly to nothing: the request waits for a later step).
//!
//! With `whole_items` (vLLM's `disable_chunked_mm_input`, which models that attend
//! bidirectionally inside an image need) a chunk never ends inside an item it starts: it is cut
//! before that item instead. An item that a prefix-cache hit already entered is scheduled on.
//!
//! Invariants: `req.num_encoded_mm_items` items (a prefix of `req.mm_features`, which are sorted
//! and disjoint) have been encoded or lie inside a prefix-cache hit; preemption resets it to 0.
//! Costs: O(items the chunk overlaps).

use crate::request::Request;

/// The part of `num_new_tokens` (scheduled from `start`) whose new items fit in `budget` (and,
/// with `whole_items`, end inside the chunk), and the placeholder tokens of those items.
pub(super) fn fit_encoder_budget(
    req: &Request,
    start: usize,
    num_new_tokens: usize,
    budget: usize,
    whole_items: bool,
) -> (usize, usize) {
    let end = start + num_new_tokens;
    let mut cost = 0;
    for f in &req.mm_features[req.num_encoded_mm_items.min(req.mm_features.len())..] {
        if f.offset >= end {
            break;
        }
        if f.offset + f.length <= start {
            continue; // inside a prefix-cache hit: never encoded
        }
        if cost + f.length > budget {
            return (f.offset.max(start) - start, cost);
        }
        if whole_items && f.offset >= start && f.offset + f.length > end {
            return (f.offset - start, cost);
        }
        cost += f.length;
    }
    (num_new_tokens, cost)
}

/// Records that every item starting before `end` is encoded (or skipped by a prefix hit).
pub(super) fn mark_encoded(req: &mut Request, end: usize) {
    req.num_encoded_mm_items = req.mm_features.partition_point(|f| f.offset < end);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::MultiModalFeature;
    use crate::request::{EngineRequest, SamplingOptions};

    /// A 100-token prompt with items of 10 tokens at 10, 30 and 50.
    fn request() -> Request {
        let feature = |offset| MultiModalFeature { identifier: format!("img{offset}"), offset, length: 10 };
        let mut r =
            Request::new(EngineRequest::new("r", (0..100).collect(), SamplingOptions::default()), 0, 1000);
        r.mm_features = vec![feature(10), feature(30), feature(50)];
        r
    }

    #[test]
    fn chunk_within_budget_is_kept_whole() {
        assert_eq!(fit_encoder_budget(&request(), 0, 100, 30, false), (100, 30));
    }

    #[test]
    fn chunk_is_cut_before_the_first_item_that_does_not_fit() {
        assert_eq!(fit_encoder_budget(&request(), 0, 100, 25, false), (50, 20));
        assert_eq!(fit_encoder_budget(&request(), 0, 100, 5, false), (10, 0));
    }

    #[test]
    fn encoded_items_cost_nothing_again() {
        let mut r = request();
        mark_encoded(&mut r, 35); // the first two items started
        assert_eq!(r.num_encoded_mm_items, 2);
        assert_eq!(fit_encoder_budget(&r, 35, 65, 10, false), (65, 10));
    }

    #[test]
    fn items_inside_a_prefix_hit_are_skipped_but_a_split_one_is_encoded() {
        let r = request();
        // A hit up to 35 covers the first item and half of the second.
        assert_eq!(fit_encoder_budget(&r, 35, 65, 20, false), (65, 20));
        assert_eq!(
            fit_encoder_budget(&r, 35, 65, 5, false),
            (0, 0),
            "the split item must be encoded to go on"
        );
    }

    #[test]
    fn whole_items_cut_a_chunk_before_an_item_it_would_split() {
        // Items at 10..20 and 30..40: a 35-token chunk from 0 would end inside the second.
        assert_eq!(fit_encoder_budget(&request(), 0, 35, 100, true), (30, 10));
        assert_eq!(fit_encoder_budget(&request(), 0, 35, 100, false), (35, 20));
        assert_eq!(fit_encoder_budget(&request(), 12, 5, 100, true), (5, 10), "an entered item goes on");
        assert_eq!(fit_encoder_budget(&request(), 10, 5, 100, true), (0, 0), "waits to take the item whole");
    }
}
