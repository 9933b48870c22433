"""What the model runner keeps per request between steps: the Python-side sampling parameters
the core does not carry (logit_bias, allowed_token_ids), the seeded generator, the token history
penalties need, and the logprobs gathered for the final output."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferrollm.model_executor.sampling_metadata import make_generator
from ferrollm.sampling_params import SamplingParams
from ferrollm.worker.mm_state import RequestMultiModal


@dataclass
class CachedRequestState:
    """One request as the runner knows it.

    Attributes:
        request_id: the core's request id.
        params: the user's sampling parameters.
        prompt_token_ids: the prompt, from the core's new-request data.
        output_token_ids: tokens sampled so far (kept across preemption).
        generator: the request's own generator when it has a seed.
        sample_logprobs: per generated token, (token ids, logprobs, rank of the sampled token).
        prompt_logprobs: per prompt position after the first, (token ids, logprobs, rank).
        mm: the request's images, M-RoPE table and kept encoder outputs (None: text only).
    """

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    sample_logprobs: list[tuple[np.ndarray, np.ndarray, int]] = field(default_factory=list)
    prompt_logprobs: list[tuple[np.ndarray, np.ndarray, int]] = field(default_factory=list)
    mm: RequestMultiModal | None = None

    @classmethod
    def create(cls, request_id: str, params: SamplingParams, prompt_token_ids: list[int], device: torch.device) -> CachedRequestState:
        generator = make_generator(params.seed, device) if params.seed is not None else None
        return cls(request_id, params, list(prompt_token_ids), generator=generator)
