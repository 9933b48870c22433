"""`Worker`: one tensor-parallel rank's model, KV cache and runner.

Rank 0's worker lives in the caller's process; the others in spawned `WorkerProc`s
(executor/multiproc_executor.py). Every rank goes through the same verbs, called by
`collective_rpc`: ``load_model`` (returns how many KV blocks this rank can hold),
``init_kv_cache`` (with the number every rank agreed on, the minimum), ``execute_model`` per step,
``save_sharded_state``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from ferrollm._core import SchedulerOutput
from ferrollm.attention.backend import allocate_kv_cache
from ferrollm.config.compilation import CompilationConfig
from ferrollm.config.model_config import ModelConfig, text_config_of
from ferrollm.engine.kv_memory import (
    CPU_BUDGET_HINT,
    bytes_per_block,
    check_block_override,
    cpu_kv_cache_bytes,
    gpu_budget_hint,
    kv_cache_torch_dtype,
    num_kv_blocks,
)
from ferrollm.exceptions import EngineError
from ferrollm.worker.model_runner import ModelRunner

logger = logging.getLogger("ferrollm")


@dataclass
class CacheOptions:
    """The engine options that size the KV cache and decide how a GPU rank runs the model (the
    same on every rank).

    ``compilation_config`` has had ``init_capture_sizes`` run: its ``capture_sizes`` are the decode
    batch sizes to capture (none with ``enforce_eager`` or on the CPU).
    """

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    load_format: str = "auto"
    # Rank 0 shows a progress bar while it reads the weights (vLLM's `use_tqdm_on_load`).
    use_tqdm_on_load: bool = False
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    # vLLM's overrides of the memory-based sizing: a block count, or the cache's bytes.
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    # Multimodal models: placeholder tokens a step may encode, and those of the largest image.
    encoder_budget: int = 0
    tokens_per_mm_item: int = 0


class Worker:
    """One rank: loads its shards of the model, holds its KV cache and runs its runner.

    Args:
        model_config: the model to run (the same on every rank).
        options: KV cache sizing and the checkpoint's load format.
        rank: this rank.
        world_size: ``tensor_parallel_size``.
        device: this rank's device.
    """

    def __init__(self, model_config: ModelConfig, options: CacheOptions, rank: int, world_size: int,
                 device: torch.device):
        self.model_config = model_config
        self.options = options
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.model: torch.nn.Module | None = None
        self.runner: ModelRunner | None = None
        # A GPU rank's start-up measurements (worker/gpu_profiler.py).
        self.memory_profile = None
        # What decided the KV cache's size, for the start-up log.
        self.kv_cache_sizing = ""

    def load_model(self) -> int:
        """Loads this rank's shards; returns how many KV blocks this rank's memory holds."""
        from ferrollm.model_executor.loader import load_model

        self.model = load_model(self.model_config, self.options.load_format, self.device,
                                self.rank, self.world_size, progress=self.options.use_tqdm_on_load and self.rank == 0)
        return self.num_kv_blocks()

    def sliding_window(self) -> int | None:
        """The window when every layer slides with one (the core frees blocks behind it)."""
        model = self._model()
        return model.sliding_window_spec() if hasattr(model, "sliding_window_spec") else None

    def num_kv_blocks(self) -> int:
        """KV blocks for this rank: `num_gpu_blocks_override` when set (on the CPU too, as a count
        that replaces any budget, vLLM's test knob for preemption); else those that fit in
        `kv_cache_memory_bytes` when set; else in ``FERROLLM_CPU_KVCACHE_SPACE`` on the CPU, or on
        a GPU in `gpu_memory_utilization` of the device less the weights, the activation peak of a
        profiled largest step, the CUDA graphs' pool and memory outside torch (as vLLM does)."""
        opts, mc = self.options, self.model_config
        # When every layer slides, the core frees blocks behind the window: a sequence then holds
        # at most the window plus one step's chunk, whatever its length.
        window = self.sliding_window()
        batched = opts.max_num_batched_tokens
        seq_tokens = mc.max_model_len if window is None else min(mc.max_model_len, window + batched + 2 * opts.block_size)
        if opts.num_gpu_blocks_override is not None:
            self.kv_cache_sizing = f"num_gpu_blocks_override={opts.num_gpu_blocks_override}"
            return check_block_override(opts.num_gpu_blocks_override, opts.block_size, seq_tokens)
        num_layers, num_kv_heads, head_dim = self._model().kv_cache_spec()
        dtype_size = kv_cache_torch_dtype(opts.kv_cache_dtype, mc.dtype).itemsize
        block_bytes = bytes_per_block(num_layers, num_kv_heads, head_dim, opts.block_size, dtype_size)
        if opts.kv_cache_memory_bytes is not None:
            budget, hint = opts.kv_cache_memory_bytes, "raise `kv_cache_memory_bytes`"
            self.kv_cache_sizing = f"kv_cache_memory_bytes={budget}"
        elif self.device.type == "cpu":
            budget, hint = cpu_kv_cache_bytes(), CPU_BUDGET_HINT
            self.kv_cache_sizing = f"FERROLLM_CPU_KVCACHE_SPACE ({budget / (1 << 30):g} GiB)"
        else:
            budget, hint = self._profile_gpu_budget(), gpu_budget_hint(opts.gpu_memory_utilization)
            self.kv_cache_sizing = f"gpu_memory_utilization={opts.gpu_memory_utilization}"
        return num_kv_blocks(budget, block_bytes, opts.block_size, seq_tokens, opts.max_num_seqs, hint)

    def _profile_gpu_budget(self) -> int:
        from ferrollm.worker.cuda_graph import host_sync_reason
        from ferrollm.worker.gpu_profiler import profile_memory

        opts, mc, model = self.options, self.model_config, self._model()
        sizes = opts.compilation_config.capture_sizes if host_sync_reason(model) is None else []
        self.memory_profile = profile_memory(
            model, mc.dtype, opts.block_size, opts.max_num_batched_tokens, opts.max_num_seqs, mc.max_model_len,
            int(text_config_of(mc.hf_config).vocab_size), sizes, self.device,
            encoder=(opts.encoder_budget, opts.tokens_per_mm_item))
        logger.info("rank %d: %s", self.rank, self.memory_profile.describe(opts.gpu_memory_utilization))
        return self.memory_profile.kv_cache_budget(opts.gpu_memory_utilization)

    def init_kv_cache(self, num_blocks: int, eos_token_ids: list[int]) -> None:
        """Allocates ``num_blocks`` KV blocks (the ranks' agreed number) and builds the runner."""
        mc, model = self.model_config, self._model()
        num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
        kv_dtype = kv_cache_torch_dtype(self.options.kv_cache_dtype, mc.dtype)
        kv_caches = allocate_kv_cache(num_layers, num_blocks, self.options.block_size, num_kv_heads, head_dim,
                                      kv_dtype, self.device)
        forward, graphs = self._gpu_forward(kv_caches) if self.device.type == "cuda" else (None, None)
        self.runner = ModelRunner(model, kv_caches, self.options.block_size, self.device,
                                  vocab_size=int(text_config_of(mc.hf_config).vocab_size), eos_token_ids=eos_token_ids,
                                  cuda_graphs=graphs, is_driver=self.rank == 0, forward=forward)

    def _gpu_forward(self, kv_caches: list[torch.Tensor]):
        """The compiled forward (None at NO_COMPILATION) and the captured decode graphs (None when
        nothing is captured) of a GPU rank."""
        from ferrollm.worker.compiler import compile_model
        from ferrollm.worker.cuda_graph import CudaGraphRunner, host_sync_reason
        from ferrollm.worker.gpu_profiler import padding_batch

        opts, mc, model = self.options, self.model_config, self._model()
        config = opts.compilation_config
        blocker = host_sync_reason(model)
        compiled = None
        if blocker is None:
            compiled = compile_model(model, config)
        elif (config.level or 0) > 0 or config.capture_sizes:
            logger.warning("%s runs eagerly, without torch.compile or CUDA graphs: %s", mc.architecture, blocker)
        if compiled is not None:
            compiled.warm_up(lambda n: padding_batch(n, opts.block_size, mc.max_model_len, self.device), kv_caches,
                             opts.max_num_batched_tokens)
        graphs = None
        if config.capture_sizes and blocker is None:
            graphs = CudaGraphRunner(compiled or model, kv_caches, config, opts.block_size, mc.max_model_len,
                                     self.device)
            graphs.capture()
            estimate = self.memory_profile.graphs if self.memory_profile else 0
            if graphs.graph_memory_bytes > 1.5 * estimate + (64 << 20):
                logger.warning("CUDA graphs took %.1f MiB, more than the %.1f MiB the profile set aside",
                               graphs.graph_memory_bytes / (1 << 20), estimate / (1 << 20))
        return compiled, graphs

    def execute_model(self, step: SchedulerOutput) -> np.ndarray:
        if self.runner is None:
            raise EngineError("execute_model before init_kv_cache")
        return self.runner.execute_model(step)

    def save_sharded_state(self, path: str, pattern: str | None, max_size: int | None) -> list[str]:
        """Writes this rank's parameters; returns the files written."""
        from ferrollm.model_executor.sharded_state import save_rank_state

        return save_rank_state(self._model(), path, self.rank, pattern, max_size)

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise EngineError("the model is not loaded yet")
        return self.model
