"""What a GPU rank measures before it sizes its KV cache, as vLLM's profile run does.

One forward of the largest step the scheduler can send (``max_num_batched_tokens`` tokens over up
to ``max_num_seqs`` requests) and one sampler pass over its rows give the activation peak. The
CUDA graphs' memory is measured by capturing two of them, the largest size and size 1, in one
pool: the first costs its pool plus the driver's copy of the graph, the second (whose pool is
reused) the driver's copy alone, which every further graph costs again. The estimate is doubled:
on an H100 the Qwen2-0.5B shape's 35 graphs measured 68 MiB this way, then took 116 MiB in one
start-up and 220 MiB in another (the driver's share varies), and a cache ~100 MiB short is far
cheaper than one that runs the device out of memory. Everything runs over a one-block scratch cache: every slot is -1 (nothing is
written) and every block-table entry is the null block, so attention reads zeros at real sequence
lengths.

The same padding batches warm up a compiled model and the CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache
from ferrollm.model_executor.sampler import Sampler
from ferrollm.model_executor.sampling_metadata import SamplingMetadata

__all__ = ["MemoryProfile", "padding_batch", "profile_memory"]

MIB = 1 << 20
# The measured graph memory is doubled (see the module docstring).
GRAPH_MEMORY_MARGIN = 2


def padding_batch(num_reqs: int, block_size: int, max_model_len: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of ``num_reqs`` padding rows: slot -1 (no write), sequence length 0 (attention
    reads nothing), token 0 at position 0."""
    max_blocks = -(-max_model_len // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_reqs,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_reqs, max_blocks, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(num_reqs + 1, dtype=torch.int32, device=device),
        seq_lens=torch.zeros(num_reqs, dtype=torch.int32, device=device),
        num_computed_tokens=torch.zeros(num_reqs, dtype=torch.int32, device=device),
        num_reqs=num_reqs, num_tokens=num_reqs, max_query_len=1, max_seq_len=max_model_len,
        block_size=block_size,
    )
    ids = torch.zeros(num_reqs, dtype=torch.int64, device=device)
    return ids, ids.clone(), meta


def prefill_batch(num_tokens: int, num_reqs: int, block_size: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``num_tokens`` prompt tokens split evenly over ``num_reqs`` requests, each from position 0,
    every block the null block, every slot -1."""
    lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int32)
    lens[: num_tokens % num_reqs] += 1
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    np.cumsum(lens, out=qsl[1:])
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int64)
    max_len = int(lens.max())
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_reqs, -(-max_len // block_size), dtype=torch.int32, device=device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(lens).to(device),
        num_computed_tokens=torch.zeros(num_reqs, dtype=torch.int32, device=device),
        num_reqs=num_reqs, num_tokens=num_tokens, max_query_len=max_len, max_seq_len=max_len,
        block_size=block_size,
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=device), torch.from_numpy(positions).to(device), meta


@dataclass
class MemoryProfile:
    """A rank's GPU memory at start-up, in bytes.

    Attributes:
        total: the device's memory.
        in_use: what torch holds once the model is loaded (its weights, mostly).
        activation_peak: above ``in_use``, the most the largest step and its sampling took.
        graphs: what the CUDA graphs will take: the largest one (its pool included) and the
            driver's copy of each of the others (0 when nothing is captured).
        non_torch: memory outside torch's allocator (the CUDA context, cuBLAS' workspace, other
            processes on the device).
        encoder_profiled: what the vision encoder ran in the profile ('' for text models).
    """

    total: int
    in_use: int
    activation_peak: int
    graphs: int
    non_torch: int
    encoder_profiled: str = ""

    def kv_cache_budget(self, gpu_memory_utilization: float) -> int:
        """``gpu_memory_utilization`` of the device, less everything else this rank will hold."""
        others = self.in_use + self.activation_peak + self.graphs + self.non_torch
        return max(0, int(self.total * gpu_memory_utilization) - others)

    def describe(self, gpu_memory_utilization: float) -> str:
        return (f"GPU memory: {self.total / MIB:.0f} MiB x {gpu_memory_utilization} = "
                f"{self.total * gpu_memory_utilization / MIB:.0f} MiB; weights and other tensors "
                f"{self.in_use / MIB:.1f} MiB, activation peak {self.activation_peak / MIB:.1f} MiB, "
                f"CUDA graphs ~{self.graphs / MIB:.1f} MiB, outside torch {self.non_torch / MIB:.1f} MiB; "
                + (f"the peak includes the vision encoder on {self.encoder_profiled}; " if self.encoder_profiled else "")
                + f"KV cache budget {self.kv_cache_budget(gpu_memory_utilization) / MIB:.1f} MiB")


@torch.inference_mode()
def profile_memory(model: torch.nn.Module, dtype: torch.dtype, block_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int, max_model_len: int, vocab_size: int, capture_sizes: list[int],
                   device: torch.device, encoder: tuple[int, int] = (0, 0)) -> MemoryProfile:
    """Runs the largest step and its sampling (and, for a multimodal model, the encoder's worst
    step), captures two decode graphs (when ``capture_sizes`` is not empty), and reads what they
    took.

    Args:
        model: the loaded model.
        dtype: the KV cache's dtype.
        capture_sizes: the decode batch sizes the engine will capture.
        encoder: (the step's encoder budget, placeholder tokens of the largest image).
    """
    from ferrollm.worker.encoder_profile import run_encoder_worst_case

    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    scratch = allocate_kv_cache(num_layers, 1, block_size, num_kv_heads, head_dim, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    in_use = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    num_reqs = max(1, min(max_num_seqs, max_num_batched_tokens))
    batch = prefill_batch(max_num_batched_tokens, num_reqs, block_size, device)
    _step_and_sample(model, scratch, batch, vocab_size, device)
    encoded = run_encoder_worst_case(model, *encoder, device)
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - in_use
    del batch
    graphs = _graph_memory(model, scratch, sorted(capture_sizes), block_size, max_model_len, device)
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(device))
    return MemoryProfile(total=total, in_use=in_use, activation_peak=activation_peak, graphs=graphs,
                         non_torch=non_torch, encoder_profiled=encoded)


def _graph_memory(model, scratch, sizes: list[int], block_size: int, max_model_len: int,
                  device: torch.device) -> int:
    """The device memory ``len(sizes)`` captured decode graphs take, from capturing two."""
    if not sizes:
        return 0
    pool = torch.cuda.graph_pool_handle()
    taken, kept = [], []
    for size in (sizes[-1], sizes[0]):
        ids, positions, meta = padding_batch(size, block_size, max_model_len, device)
        model(ids, positions, scratch, meta)  # outside the capture: kernels compiled, workspaces made
        torch.cuda.synchronize(device)
        free = torch.cuda.mem_get_info(device)[0]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = model(ids, positions, scratch, meta)
        torch.cuda.synchronize(device)
        taken.append(max(0, free - torch.cuda.mem_get_info(device)[0]))
        kept.append((graph, out))
    del kept
    torch.cuda.synchronize(device)
    return GRAPH_MEMORY_MARGIN * (taken[0] + (len(sizes) - 1) * taken[1])


def _step_and_sample(model, kv_caches, batch, vocab_size: int, device: torch.device) -> None:
    input_ids, positions, meta = batch
    hidden = model(input_ids, positions, kv_caches, meta)
    last = meta.query_start_loc[1:].long() - 1
    logits = model.compute_logits(hidden[last])
    n = logits.shape[0]
    # Random sampling with top-k and top-p: the sampler's widest path (sorts the vocabulary).
    sampling = SamplingMetadata.from_arrays(
        temperature=np.full(n, 0.8, dtype=np.float32), top_p=np.full(n, 0.9, dtype=np.float32),
        top_k=np.full(n, 50, dtype=np.int32), min_p=np.zeros(n, dtype=np.float32),
        seeds=np.full(n, -1, dtype=np.int64), presence_penalty=np.zeros(n, dtype=np.float32),
        frequency_penalty=np.zeros(n, dtype=np.float32), repetition_penalty=np.ones(n, dtype=np.float32),
        vocab_size=vocab_size, device=device,
    )
    Sampler()(logits, sampling)
