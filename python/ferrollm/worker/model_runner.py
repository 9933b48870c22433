"""The model runner: turns one step's arrays from the core into tensors, runs the model, samples,
and returns one token per scheduled request. One runner per tensor-parallel rank; only rank 0
samples.

The step arrays are wrapped with `torch.from_numpy` (no copies). Per-request Python state lives
in `CachedRequestState`, keyed by the core's request index, created from the step's new-request
data and dropped when the core reports the request finished.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrollm._core import SchedulerOutput
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.model_executor.sampler import Sampler, compute_prompt_logprobs
from ferrollm.model_executor.sampling_metadata import SamplingMetadata
from ferrollm.sampling_params import SamplingParams
from ferrollm.worker.request_state import CachedRequestState


class ModelRunner:
    """Runs a loaded model over the paged KV cache.

    Args:
        model: the model, with `forward(input_ids, positions, kv_caches, attn_metadata)` and
            `compute_logits(hidden)`.
        kv_caches: one KV tensor per layer.
        block_size: tokens per KV block.
        device: where the model runs.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.requests: dict[int, CachedRequestState] = {}
        # Parameters of requests the core has not scheduled yet, by request id.
        self._incoming: dict[str, SamplingParams] = {}
        self.finished_states: dict[str, CachedRequestState] = {}

    def add_request_params(self, request_id: str, params: SamplingParams) -> None:
        """Registers a request's Python-side parameters before the core schedules it."""
        self._incoming[request_id] = params

    def pop_finished_state(self, request_id: str) -> CachedRequestState | None:
        """The runner's record of a finished request (its logprobs), handed over once."""
        return self.finished_states.pop(request_id, None)

    def update_states(self, step: SchedulerOutput) -> None:
        """Drops finished requests and adds the new ones, in that order (indices are reused)."""
        for idx in step.finished_req_indices.tolist():
            state = self.requests.pop(idx, None)
            if state is not None:
                self.finished_states[state.request_id] = state
        for new in step.scheduled_new_reqs:
            params = self._incoming.pop(new.request_id)
            self.requests[new.req_index] = CachedRequestState.create(new.request_id, params, new.prompt_token_ids, self.device)

    def release(self, request_id: str) -> CachedRequestState | None:
        """Forgets a request that finished in the core's last update, returning its state."""
        for idx, state in self.requests.items():
            if state.request_id == request_id:
                del self.requests[idx]
                return state
        self._incoming.pop(request_id, None)
        return self.finished_states.pop(request_id, None)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> np.ndarray:
        """Runs one step and returns one sampled token id per scheduled request (int64)."""
        self.update_states(step)
        if len(step) == 0:
            return np.zeros(0, dtype=np.int64)
        meta = AttentionMetadata.from_step(step, self.block_size, self.device)
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        logits_indices = torch.from_numpy(step.logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden[logits_indices])
        states = [self.requests[i] for i in step.req_indices.tolist()]
        out = self.sampler(logits, self._sampling_metadata(step, states))
        sampled = out.sampled_token_ids.cpu().numpy()
        self._record_samples(step, states, sampled, out)
        self._record_prompt_logprobs(step, states, hidden)
        return sampled

    def _sampling_metadata(self, step: SchedulerOutput, states: list[CachedRequestState]) -> SamplingMetadata:
        return SamplingMetadata.from_step(step, states, self.device)

    def _record_samples(self, step: SchedulerOutput, states: list[CachedRequestState], sampled: np.ndarray, out) -> None:
        keep = step.needs_sample
        lp_ids = out.logprob_token_ids.cpu().numpy() if out.logprob_token_ids is not None else None
        lps = out.logprobs.cpu().numpy() if out.logprobs is not None else None
        ranks = out.sampled_token_ranks.cpu().numpy() if out.sampled_token_ranks is not None else None
        for row, state in enumerate(states):
            if not keep[row]:
                continue
            state.output_token_ids.append(int(sampled[row]))
            k = state.params.logprobs
            if k is not None and lp_ids is not None:
                state.sample_logprobs.append((lp_ids[row, : k + 1], lps[row, : k + 1], int(ranks[row])))

    def _record_prompt_logprobs(self, step: SchedulerOutput, states: list[CachedRequestState], hidden: torch.Tensor) -> None:
        qsl = step.query_start_loc
        for row, state in enumerate(states):
            k = state.params.prompt_logprobs
            if k is None:
                continue
            start = int(step.num_computed_tokens[row])
            n = int(step.num_scheduled_tokens[row])
            # Position p predicts token p + 1; only prompt tokens after the first are scored.
            end = min(start + n, len(state.prompt_token_ids) - 1)
            if end <= start:
                continue
            rows = hidden[int(qsl[row]) : int(qsl[row]) + (end - start)]
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
            ids, lps, ranks = compute_prompt_logprobs(self.model.compute_logits(rows), targets, k)
            ids, lps, ranks = ids.cpu().numpy(), lps.cpu().numpy(), ranks.cpu().numpy()
            state.prompt_logprobs.extend((ids[i], lps[i], int(ranks[i])) for i in range(end - start))
