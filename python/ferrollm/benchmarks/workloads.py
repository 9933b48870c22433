"""Random-token workloads, as vLLM's `random` dataset draws them: each request's input and output
lengths are drawn uniformly from `[len * (1 - ratio), len * (1 + ratio)]`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def _lengths(rng: np.random.Generator, center: int, ratio: float, n: int) -> np.ndarray:
    lo = max(1, int(center * (1 - ratio)))
    hi = max(lo, int(center * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int,
                    range_ratio: float = 0.0, seed: int = 0, reserved_ids: int = 16) -> list[BenchRequest]:
    """`num_prompts` requests of random token ids, avoiding the lowest ids (special tokens).

    Args:
        range_ratio: spread of the lengths around `input_len` / `output_len`, in [0, 1).
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"`random_range_ratio` must be in [0, 1). Given: {range_ratio}")
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, input_len, range_ratio, num_prompts)
    outs = _lengths(rng, output_len, range_ratio, num_prompts)
    return [
        BenchRequest(rng.integers(reserved_ids, vocab_size, size=int(i)).tolist(), int(o))
        for i, o in zip(ins, outs)
    ]
