"""What start-up logs at INFO: where its time went, and the memory the engine will hold (weights,
KV cache, the largest activation workspace of a step), so peak memory can be predicted before
the first request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrollm.model_executor.layers.cpu_gemm import MLP_SLAB_ROWS
from ferrollm.model_executor.layers.cpu_weights import checkpoint_mappings

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["KVCacheSummary", "StartupClock", "activation_workspace_bytes", "log_memory", "model_weight_bytes"]

logger = logging.getLogger("ferrollm")
MIB = 1 << 20


class StartupClock:
    """Wall time of each named start-up phase, in order."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - began

    def log(self) -> None:
        total = time.perf_counter() - self.start
        parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in self.phases.items())
        logger.info("start-up took %.2f s: %s", total, parts)


def model_weight_bytes(model: nn.Module) -> tuple[int, int]:
    """``(bytes, bytes mapped from the checkpoint file)`` of the weights ``model`` holds: its
    parameters and its layers' CPU forms, each tensor counted once (tied embeddings, a tied LM
    head reading the embedding's table)."""
    tensors: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.device.type != "meta":
                tensors[param.data_ptr()] = param.numel() * param.element_size()
        form = getattr(module, "_cpu", None)
        if form is not None:
            tensors.update(form.tensors())
    ranges = checkpoint_mappings()
    mapped = sum(n for ptr, n in tensors.items() if any(lo <= ptr < hi for lo, hi in ranges))
    return sum(tensors.values()), mapped


def activation_workspace_bytes(config: PretrainedConfig, dtype: torch.dtype, num_tokens: int, num_seqs: int) -> int:
    """An estimate of the largest step's activations: ``num_tokens`` (`max_num_batched_tokens`)
    rows of hidden states, residuals and q/k/v, one MLP slab's intermediates, and float32 logits
    (and their sampling copy) for up to ``num_seqs`` (`max_num_seqs`) rows."""
    size = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = (4 * hidden + (heads + 2 * kv_heads) * head_dim) * size
    mlp = min(num_tokens, MLP_SLAB_ROWS) * 3 * intermediate * size
    logits = min(num_seqs, num_tokens) * config.vocab_size * 4 * 2
    return num_tokens * per_token + mlp + logits


@dataclass
class KVCacheSummary:
    """Rank 0's KV cache as start-up logs it."""

    bytes: int
    num_blocks: int
    block_size: int
    dtype: str
    # What set its size: "num_gpu_blocks_override=...", "kv_cache_memory_bytes=...", the CPU
    # budget's environment variable, or the GPU's `gpu_memory_utilization`.
    sizing: str

    @property
    def bytes_per_token(self) -> int:
        return self.bytes // max(1, self.num_blocks * self.block_size)


def log_memory(weights: tuple[int, int], kv: KVCacheSummary, workspace: int, num_tokens: int, num_seqs: int) -> None:
    total, mapped = weights
    logger.info(
        "memory: weights %.1f MiB (%.1f MiB of them mapped from the checkpoint file), KV cache %.1f MiB "
        "(%d bytes, %d blocks of %d tokens, %s, %d bytes per token; sized by %s), largest activation "
        "workspace ~%.1f MiB (max_num_batched_tokens=%d, max_num_seqs=%d)", total / MIB, mapped / MIB,
        kv.bytes / MIB, kv.bytes, kv.num_blocks, kv.block_size, kv.dtype, kv.bytes_per_token, kv.sizing,
        workspace / MIB, num_tokens, num_seqs)
