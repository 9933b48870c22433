"""`VllmConfig`: the resolved engine configuration under vLLM's names
(`llm.llm_engine.vllm_config.cache_config.num_gpu_blocks`, `.scheduler_config.max_num_seqs`, ...),
for scripts that read it. It is a read-out: the engine is built from `EngineArgs`, and changing
these objects changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrollm.config.compilation import CompilationConfig
from ferrollm.config.model_config import ModelConfig


@dataclass
class CacheConfig:
    """The paged KV cache. `num_gpu_blocks` is the number of blocks allocated (on the CPU too)."""

    block_size: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    num_gpu_blocks: int | None
    cache_dtype: str = "auto"


@dataclass
class ParallelConfig:
    """How the model is sharded: tensor parallelism on one machine only."""

    tensor_parallel_size: int
    distributed_executor_backend: str | None
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class SchedulerConfig:
    """The scheduler's limits."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True


@dataclass
class LoadConfig:
    """How the weights were loaded."""

    load_format: str
    download_dir: str | None
    use_tqdm_on_load: bool


@dataclass
class VllmConfig:
    """The engine's configuration, grouped as vLLM groups it."""

    model_config: ModelConfig
    cache_config: CacheConfig
    parallel_config: ParallelConfig
    scheduler_config: SchedulerConfig
    load_config: LoadConfig
    compilation_config: CompilationConfig


def build_vllm_config(args: Any, model_config: ModelConfig, num_gpu_blocks: int | None,
                      max_num_batched_tokens: int) -> VllmConfig:
    """The read-out of an engine built from `args` (an `EngineArgs`)."""
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(args.block_size, args.gpu_memory_utilization, bool(args.enable_prefix_caching),
                                 num_gpu_blocks, args.kv_cache_dtype),
        parallel_config=ParallelConfig(args.tensor_parallel_size, args.distributed_executor_backend),
        scheduler_config=SchedulerConfig(args.max_num_seqs, max_num_batched_tokens, model_config.max_model_len,
                                         args.scheduling_policy, args.enable_chunked_prefill is not False),
        load_config=LoadConfig(args.load_format, args.download_dir, bool(args.use_tqdm_on_load)),
        compilation_config=CompilationConfig.from_value(args.compilation_config),
    )
