"""The model runner: turns one step's arrays from the core into tensors, runs the model, samples,
and returns one token per scheduled request. One runner per tensor-parallel rank; only rank 0
(the driver) samples. The other ranks run the same steps and join every collective the driver
makes, the LM head's logits gathers included (sampled rows and prompt-logprob rows), then stop
short of sampling.

The step arrays are wrapped with `torch.from_numpy` (no copies). Per-request Python state lives
in `CachedRequestState`, keyed by the core's request index, created from the step's new-request
data and dropped when the core reports the request finished.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ferrollm._core import SamplingOptions, SchedulerOutput
from ferrollm.attention.backend import AttentionMetadata, step_tensor
from ferrollm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from ferrollm.model_executor.sampler import Sampler, SamplerOutput, compute_prompt_logprobs
from ferrollm.model_executor.sampling_metadata import SamplingMetadata
from ferrollm.model_executor.sampling_ops import row_uniforms
from ferrollm.multimodal.inputs import MultiModalInputs
from ferrollm.sampling_params import SamplingParams
from ferrollm.worker.cpu_allocator import keep_freed_memory
from ferrollm.worker.cuda_graph import CudaGraphRunner
from ferrollm.worker.mm_broadcast import broadcast_multimodal_step
from ferrollm.worker.mm_state import RequestMultiModal, image_spans, prepare_multimodal_step
from ferrollm.worker.request_state import CachedRequestState


class ModelRunner:
    """Runs a loaded model over the paged KV cache.

    Args:
        model: the model, with `forward(input_ids, positions, kv_caches, attn_metadata)` and
            `compute_logits(hidden)`.
        kv_caches: one KV tensor per layer.
        block_size: tokens per KV block.
        device: where the model runs.
        cuda_graphs: replays captured decode steps (CUDA only); None runs every step eagerly.
        is_driver: rank 0, which samples; other ranks only take part in the collectives and
            know a request's parameters from the core's new-request data.
        forward: the model's compiled forward (worker/compiler.py), run instead of ``model``
            for the steps no graph replays; None runs ``model``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        vocab_size: int,
        eos_token_ids: list[int],
        cuda_graphs: CudaGraphRunner | None = None,
        is_driver: bool = True,
        forward: Callable[..., torch.Tensor] | None = None,
    ):
        self.model = model
        self.forward = forward or model
        self.is_driver = is_driver
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.sampler = Sampler()
        # The engine's custom logits processors (driver only), set by the engine after start-up.
        self.logits_processors: Any = None
        self.requests: dict[int, CachedRequestState] = {}
        if device.type == "cpu":
            keep_freed_memory()  # after loading: see cpu_allocator
        self._index_of: dict[str, int] = {}
        # Parameters of requests the core has not scheduled yet, by request id.
        self._incoming: dict[str, SamplingParams] = {}
        self._incoming_mm: dict[str, MultiModalInputs] = {}
        # The last step's sampling rows and their metadata, reused while they sample alike.
        self._steady_sampling: tuple[list[CachedRequestState], SamplingMetadata] | None = None
        # Finished requests' states awaiting `release` (see `hold`).
        self._held: dict[str, CachedRequestState | None] = {}
        # Multimodal models take M-RoPE positions and image embeddings (worker/mm_state.py).
        self.is_multimodal = bool(getattr(model, "supports_multimodal", False))

    def add_request_params(self, request_id: str, params: SamplingParams,
                           mm_inputs: MultiModalInputs | None = None) -> None:
        """Registers a request's Python-side parameters (and its processed images) before the
        core schedules it."""
        self._incoming[request_id] = params
        if mm_inputs is not None and mm_inputs.items:
            self._incoming_mm[request_id] = mm_inputs

    def update_states(self, step: SchedulerOutput) -> None:
        """Drops finished requests and adds the new ones, in that order (indices are reused)."""
        lps = self.logits_processors
        for idx in step.finished_req_indices.tolist():
            state = self.requests.pop(idx, None)
            if state is not None:
                self._index_of.pop(state.request_id, None)
            if lps is not None:
                lps.remove(idx)
        for new in step.scheduled_new_reqs:
            params = self._incoming.pop(new.request_id) if self.is_driver else _worker_params(new.sampling)
            state = CachedRequestState.create(new.request_id, params, new.prompt_token_ids, self.device)
            mm_inputs = self._incoming_mm.pop(new.request_id, None)
            if mm_inputs is not None:
                state.mm = RequestMultiModal.create(self.model, mm_inputs)
            self.requests[new.req_index] = state
            self._index_of[new.request_id] = new.req_index
            if lps is not None:
                lps.add(new.req_index, params, state.prompt_token_ids, state.output_token_ids)

    def hold(self, request_id: str) -> None:
        """Detaches a finished request's state from its index, which the next step may reuse,
        until `release` hands it over (`async_scheduling` delivers outputs one step later)."""
        self._held[request_id] = self.release(request_id)

    def state_of(self, request_id: str) -> CachedRequestState | None:
        """A scheduled request's state, left in place (streaming reads its logprobs each step)."""
        if request_id in self._held:
            return self._held[request_id]
        idx = self._index_of.get(request_id)
        return None if idx is None else self.requests.get(idx)

    def release(self, request_id: str) -> CachedRequestState | None:
        """Hands over and forgets the state of a request whose final output the core just gave
        (its logprobs); None if it never reached the runner."""
        if request_id in self._held:
            return self._held.pop(request_id)
        self._incoming.pop(request_id, None)
        self._incoming_mm.pop(request_id, None)
        idx = self._index_of.pop(request_id, None)
        state = None if idx is None else self.requests.pop(idx, None)
        # Only the driver's logits are whole (the LM head gathers to rank 0): another rank's
        # outputs (external launcher) carry no logprobs rather than wrong ones.
        return state if self.is_driver else None

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> np.ndarray:
        """Runs one step and returns one sampled token id per scheduled request (int64)."""
        self.update_states(step)
        if len(step) == 0:
            return np.zeros(0, dtype=np.int64)
        meta = AttentionMetadata.from_step(step, self.block_size, self.device)
        input_ids = step_tensor(step.input_ids, self.device)
        states = [self.requests[i] for i in step.req_indices.tolist()]
        sampled = self._sample_in_model(step, meta, input_ids, states)
        if sampled is not None:
            return sampled
        if self.is_multimodal:
            positions, mm_embeds, meta.image_spans = self._multimodal_step(step, states)
            hidden = self.forward(input_ids, positions, self.kv_caches, meta, mm_embeds=mm_embeds)
        else:
            positions = step_tensor(step.positions, self.device)
            hidden = self.cuda_graphs.execute(input_ids, positions, meta) if self.cuda_graphs else None
            if hidden is None:
                hidden = self.forward(input_ids, positions, self.kv_caches, meta)
        self._record_prompt_logprobs(step, states, hidden)
        # Only rows whose step completes their known tokens sample: a prefill chunk must not
        # draw from a seeded generator, or the output would depend on how the prompt was split.
        rows = np.flatnonzero(step.needs_sample)
        sampled = np.zeros(len(step), dtype=np.int64)
        if len(rows) == 0:
            return sampled
        logits_indices = step_tensor(step.logits_indices[rows], self.device)
        logits = self.model.compute_logits(hidden[logits_indices])
        if not self.is_driver:
            return sampled
        sampling_states = [states[r] for r in rows]
        if self.logits_processors is not None:
            self.logits_processors.begin_step(step.req_indices[rows].tolist())
        out = self.sampler(logits, self._sampling_metadata(step, rows, sampling_states))
        sampled[rows] = out.sampled_token_ids.cpu().numpy()
        self._record_samples(sampling_states, sampled[rows], out)
        return sampled

    def _sample_in_model(self, step: SchedulerOutput, meta: AttentionMetadata, input_ids: torch.Tensor,
                         states: list[CachedRequestState]) -> np.ndarray | None:
        """The tokens of a decode step whose rows all sample greedily, or all at temperature 1
        with no filter, with no logprobs and nothing that edits the logits, from the model's
        `sample_tokens` (the LM head and the draw inside the CPU decoder's call), recorded as the
        sampler's would be; None to run the step as usual. The sampler's own argmax or draw of
        the same logits, at the same uniform numbers from the same generators."""
        sample_tokens = getattr(self.model, "sample_tokens", None)
        if sample_tokens is None or not self._rows_may_sample_in_model(step, meta, states):
            return None
        sampling = self._sampling_metadata(step, np.arange(len(step)), states)
        plain = _as_drawn(sampling)
        if plain is None:
            return None
        uniforms = (lambda: row_uniforms(len(step), sampling.generators).view(-1)) if plain == "random" else None
        tokens = sample_tokens(input_ids, step_tensor(step.positions, self.device), self.kv_caches, meta, uniforms)
        if tokens is None:
            return None
        sampled = tokens.numpy()
        self._record_samples(states, sampled, SamplerOutput(tokens))
        return sampled

    def _rows_may_sample_in_model(self, step: SchedulerOutput, meta: AttentionMetadata,
                                  states: list[CachedRequestState]) -> bool:
        """A text step of decode rows that all sample, on the CPU's one rank with no custom
        logits processors, none asking prompt logprobs or sampling unsteadily (its metadata would
        then be built twice). One rank only: with tensor parallelism the other ranks would not
        join the collectives of a model call that then falls back to `forward`."""
        return (self.is_driver and get_tensor_model_parallel_world_size() == 1 and not self.is_multimodal
                and self.cuda_graphs is None and self.logits_processors is None and meta.is_decode_only
                and bool(step.needs_sample.all())
                and all(s.params.prompt_logprobs is None and _samples_steadily(s) for s in states))

    def _multimodal_step(self, step: SchedulerOutput, states: list[CachedRequestState]):
        """The step's positions, placeholder embeddings and (for models attending both ways
        inside an image) image spans. The driver holds the images and encodes them; with
        tensor parallelism it sends the result to the other ranks (`mm_broadcast`)."""
        embeds, spans = None, None
        if get_tensor_model_parallel_rank() == 0:
            mm = [s.mm for s in states]
            positions, embeds = prepare_multimodal_step(self.model, step, mm, self.device)
            if embeds is not None and getattr(self.model, "bidirectional_mm_attention", False):
                spans = image_spans(step, mm)
        else:  # the core's positions, replaced by the driver's M-RoPE ones when it sends them
            positions = step_tensor(step.positions, self.device)
        if get_tensor_model_parallel_world_size() > 1:
            positions, embeds, spans = broadcast_multimodal_step(positions, embeds, spans, self.device)
        return positions, embeds, spans

    def _sampling_metadata(self, step: SchedulerOutput, rows: np.ndarray, states: list[CachedRequestState]) -> SamplingMetadata:
        """The step's sampling inputs. Rows that sample the same way every step (no penalties,
        bad words, pending `min_tokens` or custom processors: nothing that reads the outputs so
        far) get the same metadata while the same requests sample in the same order, so it is
        built once for them: rebuilt each step it cost ~0.3 ms of small ops, ~1.5% of a
        Qwen2-0.5B Q4_0 decode step at batch 1."""
        steady = self.logits_processors is None and all(_samples_steadily(s) for s in states)
        last = self._steady_sampling
        if steady and last is not None and len(last[0]) == len(states) and all(
                a is b for a, b in zip(last[0], states)):
            return last[1]
        meta = self._build_sampling_metadata(step, rows, states)
        # The states are held with it, so no other request can take their place unnoticed.
        self._steady_sampling = (states, meta) if steady else None
        return meta

    def _build_sampling_metadata(self, step: SchedulerOutput, rows: np.ndarray,
                                 states: list[CachedRequestState]) -> SamplingMetadata:
        params = [s.params for s in states]
        penalties = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params)
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata.from_arrays(
            temperature=step.temperature[rows],
            top_p=step.top_p[rows],
            top_k=step.top_k[rows],
            min_p=step.min_p[rows],
            seeds=step.seeds[rows],
            presence_penalty=step.presence_penalty[rows],
            frequency_penalty=step.frequency_penalty[rows],
            repetition_penalty=step.repetition_penalty[rows],
            vocab_size=self.vocab_size,
            device=self.device,
            generators={row: s.generator for row, s in enumerate(states) if s.generator is not None},
            prompt_token_ids=[s.prompt_token_ids for s in states] if penalties else None,
            output_token_ids=[s.output_token_ids for s in states] if penalties else None,
            logit_bias=[p.logit_bias for p in params] if any(p.logit_bias for p in params) else None,
            allowed_token_ids=[p.allowed_token_ids for p in params] if any(p.allowed_token_ids for p in params) else None,
            min_tokens_stop_ids=self._min_tokens_stop_ids(states),
            max_num_logprobs=(-1 if -1 in logprobs else max(logprobs)) if logprobs else None,
            bad_words_ids=_bad_word_ids(states),
            logits_processors=self.logits_processors.active if self.logits_processors else (),
        )

    def _min_tokens_stop_ids(self, states: list[CachedRequestState]) -> list[list[int] | None] | None:
        """EOS and stop ids may not be sampled while a request is short of `min_tokens`."""
        rows: list[list[int] | None] = []
        for s in states:
            short = len(s.output_token_ids) < s.params.min_tokens
            eos = [] if s.params.ignore_eos else self.eos_token_ids
            rows.append(eos + list(s.params.stop_token_ids or []) if short else None)
        return rows if any(r is not None for r in rows) else None

    def _record_samples(self, states: list[CachedRequestState], sampled: np.ndarray, out) -> None:
        lp_ids = out.logprob_token_ids.cpu().numpy() if out.logprob_token_ids is not None else None
        lps = out.logprobs.cpu().numpy() if out.logprobs is not None else None
        ranks = out.sampled_token_ranks.cpu().numpy() if out.sampled_token_ranks is not None else None
        for row, state in enumerate(states):
            state.output_token_ids.append(int(sampled[row]))
            k = state.params.logprobs
            if k is not None and lp_ids is not None:
                width = lp_ids.shape[1] if k < 0 else k + 1
                state.sample_logprobs.append((lp_ids[row, :width], lps[row, :width], int(ranks[row])))

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
            logits = self.model.compute_logits(rows)
            if not self.is_driver:
                continue
            targets = torch.tensor(state.prompt_token_ids[start + 1 : end + 1], device=self.device)
            ids, lps, ranks = compute_prompt_logprobs(logits, targets, k, self.sampler.logprobs_mode)
            ids, lps, ranks = ids.cpu().numpy(), lps.cpu().numpy(), ranks.cpu().numpy()
            state.prompt_logprobs.extend((ids[i], lps[i], int(ranks[i])) for i in range(end - start))


def _as_drawn(meta: SamplingMetadata) -> str | None:
    """``"greedy"`` where every row takes its argmax of the model's logits as they are, ``"random"``
    where every row draws from them at temperature 1 with no top-k, top-p or min-p; None where
    logprobs are asked or a stage of `Sampler._process_logits_` edits the logits."""
    if (meta.max_num_logprobs is not None or not meta.no_penalties or meta.allowed_token_ids_mask is not None
            or meta.bad_words is not None or meta.min_tokens_stop is not None or meta.logit_bias is not None
            or meta.logits_processors):
        return None
    if meta.all_greedy:
        return "greedy"
    if meta.all_random and meta.unit_temperature and meta.no_top_k and meta.no_top_p and meta.no_min_p:
        return "random"
    return None


def _samples_steadily(state: CachedRequestState) -> bool:
    """Whether the request's sampling metadata is the same every step from now on: nothing in
    it depends on the tokens generated so far."""
    p = state.params
    return (not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)
            and not p.bad_words_token_ids
            and len(state.output_token_ids) >= p.min_tokens)


def _bad_word_ids(states: list[CachedRequestState]) -> list[list[int] | None] | None:
    """Per row, the last token of every bad word whose other tokens end the output so far (a
    one-token word is always blocked), as vLLM matches them: against generated tokens only."""
    rows: list[list[int] | None] = []
    for s in states:
        words = s.params.bad_words_token_ids
        if not words:
            rows.append(None)
            continue
        out = s.output_token_ids
        rows.append([w[-1] for w in words
                     if len(w) <= len(out) + 1 and (len(w) == 1 or out[len(out) - len(w) + 1:] == w[:-1])])
    return rows if any(rows) else None


def _worker_params(options: SamplingOptions) -> SamplingParams:
    # A worker rank only needs to know which rows the driver computes logits for: its sampled
    # rows (from the step's arrays) and, for requests that asked, their prompt rows.
    return SamplingParams(prompt_logprobs=None if options.prompt_logprobs is None else -1)
