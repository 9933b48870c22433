"""How many KV blocks the cache gets, and in which element type.

`num_gpu_blocks_override` (vLLM's) sets the count outright, on the CPU too; `kv_cache_memory_bytes`
(vLLM's) replaces the memory budget below on either device. Otherwise, on the CPU the cache takes `FERROLLM_CPU_KVCACHE_SPACE` GiB (`VLLM_CPU_KVCACHE_SPACE` is accepted
as an alias; default 4). On a GPU it takes `gpu_memory_utilization` of the device less the
weights, the profiled activation peak, the CUDA graphs' pool and memory outside torch
(worker/gpu_profiler.py). The pool never grows past what `max_num_seqs` sequences of
`max_model_len` tokens can use, so a small model with a short context does not reserve GiBs it
can never touch. If one `max_model_len` sequence does not fit, start-up fails with the largest
length that would and the options that help.
"""

from __future__ import annotations

import os

import torch

from ferrollm.exceptions import KVCacheTooSmallError

GIB = 1 << 30
DEFAULT_CPU_KVCACHE_GIB = 4.0
_ENV_VARS = ("FERROLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE")


def cpu_kv_cache_bytes() -> int:
    """The CPU KV cache budget in bytes, from the environment."""
    for name in _ENV_VARS:
        value = os.environ.get(name)
        if value:
            try:
                gib = float(value)
            except ValueError:
                raise KVCacheTooSmallError(f"`{name}` must be a number of GiB. Given: {value!r}") from None
            if gib <= 0:
                raise KVCacheTooSmallError(f"`{name}` must be > 0 GiB. Given: {value}")
            return int(gib * GIB)
    return int(DEFAULT_CPU_KVCACHE_GIB * GIB)


def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_size: int) -> int:
    """K and V of every layer for one block of tokens."""
    return 2 * num_layers * num_kv_heads * head_dim * block_size * dtype_size


CPU_BUDGET_HINT = "raise FERROLLM_CPU_KVCACHE_SPACE (GiB)"


def gpu_budget_hint(gpu_memory_utilization: float) -> str:
    return f"raise `gpu_memory_utilization` (now {gpu_memory_utilization}), lower `max_num_batched_tokens`"


def num_kv_blocks(budget_bytes: int, block_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
                  budget_hint: str = CPU_BUDGET_HINT) -> int:
    """Blocks in the pool, the reserved null block included: all of them fit in the budget, so the
    cache never takes more bytes than were asked for.

    Raises:
        KVCacheTooSmallError: one `max_model_len` sequence does not fit in the budget.
    """
    usable = max(0, budget_bytes // block_bytes - 1)  # one block is the null block
    needed_one = -(-max_model_len // block_size)
    if usable < needed_one:
        fits = usable * block_size
        raise KVCacheTooSmallError(
            f"the KV cache ({budget_bytes / GIB:.3f} GiB, {usable} blocks of {block_size} tokens) holds "
            f"{fits} tokens, fewer than one sequence of `max_model_len`={max_model_len} needs; the "
            f"largest `max_model_len` that fits is {fits}. Lower `max_model_len`, {budget_hint}, "
            f"use a quantized model or a larger `tensor_parallel_size`."
        )
    useful = max_num_seqs * needed_one
    return min(usable, useful) + 1


def check_block_override(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """`num_gpu_blocks_override` as the pool's block count (the null block included), once one
    `max_model_len` sequence is known to fit.

    Raises:
        KVCacheTooSmallError: it does not.
    """
    usable = num_blocks - 1
    needed = -(-max_model_len // block_size)
    if usable < needed:
        raise KVCacheTooSmallError(
            f"`num_gpu_blocks_override`={num_blocks} leaves {usable} blocks of {block_size} tokens "
            f"({usable * block_size} tokens, one block is the null block), fewer than one sequence of "
            f"`max_model_len`={max_model_len} needs ({needed} blocks). Raise it to >= {needed + 1} or lower "
            f"`max_model_len` to <= {usable * block_size}.")
    return num_blocks


# vLLM's `kv_cache_dtype` names: "fp8" is e4m3, as on vLLM's CUDA and CPU backends.
_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's for "auto", else the fp8 format named."""
    return model_dtype if kv_cache_dtype == "auto" else _FP8_DTYPES[kv_cache_dtype]
