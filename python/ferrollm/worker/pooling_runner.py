"""The pooling model runner: runs a step's prompts through the model and pools the hidden states
instead of sampling.

The Rust core schedules pooling requests like any other: each is added with ``max_tokens=1``
to a core built without chunked prefill or prefix caching, so a request's whole prompt is in the
step that schedules it, and the placeholder token this runner returns for it ends it in that
step's ``update``. The pooled result waits here, keyed by request id, until the caller collects
it with :meth:`release` when the core reports the request finished.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrollm._core import SchedulerOutput
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import EngineError
from ferrollm.model_executor.layers.pooler import Pooler
from ferrollm.pooling_params import PoolingParams


class PoolingModelRunner:
    """Runs a model over whole prompts and pools each one.

    Args:
        model: a model with ``forward(input_ids, positions, kv_caches, attn_metadata)``
            returning the final hidden states.
        kv_caches: one KV tensor per layer for decoders (sized for one step), ``[]`` for
            encoders.
        block_size: tokens per KV block.
        device: where the model runs.
        pooling_type: the model's resolved pooling (``"CLS"``, ``"LAST"``, ``"MEAN"``, ``"ALL"``).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 device: torch.device, pooling_type: str):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.pooler = Pooler(pooling_type)
        # Scheduled requests by the core's request index: (request id, params).
        self.requests: dict[int, tuple[str, PoolingParams]] = {}
        self._incoming: dict[str, PoolingParams] = {}
        self._results: dict[str, torch.Tensor] = {}

    def add_request_params(self, request_id: str, params: PoolingParams) -> None:
        """Registers a request's verified parameters before the core schedules it."""
        self._incoming[request_id] = params

    def update_states(self, step: SchedulerOutput) -> None:
        """Drops finished requests and adds the new ones, in that order (indices are reused)."""
        for idx in step.finished_req_indices.tolist():
            self.requests.pop(idx, None)
        for new in step.scheduled_new_reqs:
            self.requests[new.req_index] = (new.request_id, self._incoming.pop(new.request_id))

    def release(self, request_id: str) -> torch.Tensor | None:
        """Hands over a finished request's pooled tensor (None if it never ran)."""
        self._incoming.pop(request_id, None)
        return self._results.pop(request_id, None)

    @torch.inference_mode()
    def execute_model(self, step: SchedulerOutput) -> np.ndarray:
        """Runs one step, keeps each request's pooled result and returns placeholder tokens.

        Raises:
            EngineError: if the core scheduled part of a prompt (the core must be built
                without chunked prefill and prefix caching for pooling).
        """
        self.update_states(step)
        if len(step) == 0:
            return np.zeros(0, dtype=np.int64)
        if step.num_computed_tokens.any() or not step.needs_sample.all():
            raise EngineError("a pooling step must hold whole prompts; build the core with "
                              "enable_chunked_prefill=False and enable_prefix_caching=False")
        meta = AttentionMetadata.from_step(step, self.block_size, self.device)
        input_ids = torch.from_numpy(step.input_ids).to(self.device)
        positions = torch.from_numpy(step.positions).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = [self.requests[i] for i in step.req_indices.tolist()]
        pooled = self.pooler(hidden, meta.query_start_loc, [params for _, params in rows])
        for (request_id, _), result in zip(rows, pooled):
            self._results[request_id] = result
        return np.zeros(len(step), dtype=np.int64)
