"""CUDA graphs of the model's decode step, one per captured batch size.

A decode step (one token per request) launches the same kernels every time; only the numbers in
the inputs change. Each graph is recorded once over static input buffers; a step of ``n``
requests copies its arrays into the first ``n`` rows, pads up to the captured size ``N`` with rows
that do nothing, and replays. Padding rows have slot -1 (the KV write skips them) and sequence
length 0 (attention reads nothing and returns zeros), so they never touch the cache.

What makes this safe is that the decode path reads no step-dependent host value: the Triton
decode kernel's grid depends only on ``N`` and every per-request length is read on the device.
Prefill and mixed steps, and decode steps larger than the largest graph, run eagerly.

The graphs are captured over whatever ``model`` is: the eager model, or its compiled forward
(worker/compiler.py), whose attention op runs the same graph-safe kernels. A model whose decode
step reads a value back to the host (the mixture-of-experts layers count each expert's tokens on
the host) cannot be captured: :func:`host_sync_reason` says why, and such models run eagerly.

CUDA only: constructing a runner for another device is an error.
"""

from __future__ import annotations

import logging
import time

import torch

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.config.compilation import CompilationConfig
from ferrollm.exceptions import ConfigError

__all__ = ["CudaGraphRunner", "host_sync_reason"]

logger = logging.getLogger("ferrollm")
MIB = 1 << 20


def host_sync_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s forward cannot be captured or compiled in one graph, or None.

    Its forward must launch the same kernels whatever the step's numbers are; a layer that reads
    a device value back to the host (and branches on it) breaks both capture and tracing.
    """
    from ferrollm.model_executor.layers.fused_moe import FusedMoE

    if getattr(model, "supports_multimodal", False):
        return "its steps merge image embeddings and M-RoPE positions that vary with the images"
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "its mixture-of-experts layers read each expert's token count back to the host"
    return None


class CudaGraphRunner:
    """Captures and replays the decode step of ``model``.

    Args:
        model: the model, or its compiled forward: ``(input_ids, positions, kv_caches, attn_metadata)``.
        kv_caches: the per-layer caches the graphs read and write (they must never be reallocated).
        compilation_config: with :meth:`CompilationConfig.init_capture_sizes` already run.
        block_size: tokens per KV block.
        max_model_len: the longest sequence, which sizes the static block table.
        device: a CUDA device.

    Raises:
        ConfigError: if ``device`` is not CUDA.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor],
                 compilation_config: CompilationConfig, block_size: int, max_model_len: int,
                 device: torch.device | str):
        device = torch.device(device)
        if device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device. Given: {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.config = compilation_config
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Set by `capture`: wall time and device memory the graphs took.
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.num_replays = 0
        self._outputs: dict[int, torch.Tensor] = {}
        max_size = max(compilation_config.capture_sizes, default=0)
        max_blocks = -(-max_model_len // block_size)

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # Inference tensors, like every step's inputs (a compiled forward guards on that).
        with torch.inference_mode():
            self.input_ids = zeros(max_size, dtype=torch.int64)
            self.positions = zeros(max_size, dtype=torch.int64)
            self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
            self.block_tables = zeros(max_size, max_blocks, dtype=torch.int32)
            self.seq_lens = zeros(max_size, dtype=torch.int32)
            self.num_computed_tokens = zeros(max_size, dtype=torch.int32)
            # One token per request: request i's query is token i, whatever the batch.
            self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)

    @torch.inference_mode()
    def capture(self) -> None:
        """Records one graph per capture size, largest first so the smaller ones reuse its memory,
        and logs how long that took and how much device memory the graphs hold."""
        torch.cuda.synchronize(self.device)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in sorted(self.config.capture_sizes, reverse=True):
            meta = self._metadata(size)
            # Outside the capture: Triton compiles its kernels and the allocator settles. The
            # buffers hold padding rows, so this writes nothing to the cache.
            self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        sizes = sorted(self.graphs)
        logger.info("CUDA graphs: captured %d decode batch sizes (%s) in %.2f s, %.1f MiB of GPU memory",
                    len(sizes), _ranges(sizes), self.capture_seconds, self.graph_memory_bytes / MIB)

    def execute(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor | None:
        """Replays the graph that fits this step.

        Args:
            input_ids: ``[num_tokens]`` on the device.
            positions: ``[num_tokens]``.
            meta: the step's metadata, on the device.

        Returns:
            The final hidden states ``[num_reqs, hidden]``, a view of the graph's output buffer
            that the next replay overwrites; None when the step must run eagerly (not
            decode-only, too large, or its block table wider than the static one).
        """
        size = self.config.pad_for_cudagraph(meta.num_reqs) if meta.is_decode_only else None
        if size is None or size not in self.graphs or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        n = meta.num_reqs
        self._fill(self.input_ids, input_ids, n, size, 0)
        self._fill(self.positions, positions, n, size, 0)
        self._fill(self.slot_mapping, meta.slot_mapping, n, size, -1)
        self._fill(self.seq_lens, meta.seq_lens, n, size, 0)
        self._fill(self.num_computed_tokens, meta.num_computed_tokens, n, size, 0)
        # Columns past the step's width keep stale ids; seq_lens stops the walk before them.
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        self.graphs[size].replay()
        self.num_replays += 1
        return self._outputs[size][:n]

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            num_computed_tokens=self.num_computed_tokens[:size],
            num_reqs=size,
            num_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    @staticmethod
    def _fill(buffer: torch.Tensor, values: torch.Tensor, n: int, size: int, pad: int) -> None:
        buffer[:n].copy_(values, non_blocking=True)
        buffer[n:size].fill_(pad)


def _ranges(sizes: list[int]) -> str:
    return ", ".join(str(s) for s in sizes) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
