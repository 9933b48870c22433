//! Turns the requests picked by `schedule()` into the step's flat arrays and per-request diffs,
//! and advances each request's `num_computed_tokens` by what was scheduled.

use super::output::{CachedRequestData, NewRequestData, ScheduledRequest, SchedulerOutput};
use super::Scheduler;
use crate::kv_cache::NULL_BLOCK;
use crate::request::{ReqIdx, RunnerView};

impl Scheduler {
    pub(super) fn build_output(
        &mut self,
        step_id: u64,
        scheduled: Vec<ScheduledRequest>,
        preempted: Vec<ReqIdx>,
        finished: Vec<ReqIdx>,
    ) -> SchedulerOutput {
        let num_reqs = scheduled.len();
        let total: usize = scheduled.iter().map(|s| s.num_new_tokens).sum();
        let max_num_blocks = scheduled.iter().map(|s| self.kv.block_ids(s.idx).len()).max().unwrap_or(0);
        let mut out = SchedulerOutput {
            step_id,
            total_num_scheduled_tokens: total,
            max_num_blocks,
            input_ids: Vec::with_capacity(total),
            positions: Vec::with_capacity(total),
            slot_mapping: Vec::with_capacity(total),
            block_tables: Vec::with_capacity(num_reqs * max_num_blocks),
            query_start_loc: Vec::with_capacity(num_reqs + 1),
            finished_req_indices: finished.iter().map(|&i| i as i64).collect(),
            preempted_req_indices: preempted.iter().map(|&i| i as i64).collect(),
            ..Default::default()
        };
        out.query_start_loc.push(0);
        for s in scheduled {
            self.append_request(&mut out, s);
        }
        out
    }

    fn append_request(&mut self, out: &mut SchedulerOutput, s: ScheduledRequest) {
        let block_size = self.kv.block_size();
        let blocks = self.kv.block_ids(s.idx);
        let req = self.requests[s.idx].as_mut().expect("scheduled request is live");
        let start = req.num_computed_tokens;
        let end = start + s.num_new_tokens;
        for pos in start..end {
            out.input_ids.push(req.all_token_ids[pos] as i64);
            out.positions.push(pos as i64);
            let block = blocks[pos / block_size] as i64;
            out.slot_mapping.push(block * block_size as i64 + (pos % block_size) as i64);
        }
        out.block_tables.extend(blocks.iter().map(|&b| b as i32));
        let pad = out.max_num_blocks - blocks.len();
        out.block_tables.extend(std::iter::repeat_n(NULL_BLOCK as i32, pad));
        out.req_indices.push(s.idx as i64);
        out.num_scheduled_tokens.push(s.num_new_tokens as i32);
        out.num_computed_tokens.push(start as i32);
        out.seq_lens.push(end as i32);
        out.logits_indices.push(out.input_ids.len() as i64 - 1);
        out.query_start_loc.push(out.input_ids.len() as i32);
        out.needs_sample.push(end == req.num_tokens());
        out.sampling.push(&req.sampling);
        match req.runner_view {
            RunnerView::Unseen => out.scheduled_new_reqs.push(NewRequestData {
                req_index: s.idx,
                request_id: req.request_id.clone(),
                prompt_token_ids: req.prompt_token_ids().to_vec(),
                sampling: req.sampling.clone(),
                block_ids: blocks.to_vec(),
                num_computed_tokens: start,
            }),
            view => out.scheduled_cached_reqs.push(CachedRequestData {
                req_index: s.idx,
                resumed_from_preemption: view == RunnerView::Stale,
                new_block_ids: if view == RunnerView::Stale { blocks.to_vec() } else { s.new_block_ids },
                num_computed_tokens: start,
            }),
        }
        req.runner_view = RunnerView::Known;
        req.num_computed_tokens = end;
    }
}
