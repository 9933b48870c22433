"""What every attention backend reads: one step's attention metadata and the paged KV cache layout.

The engine core hands each step over as numpy arrays; :meth:`AttentionMetadata.from_step` wraps
them with ``torch.from_numpy`` so nothing is copied on the CPU (on an accelerator they are moved
once per step, asynchronously).

KV cache layout, per layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0 = keys,
1 = values). Token ``t`` of a request lives at flat slot ``block_id * block_size + offset``, which is
exactly what the core's ``slot_mapping`` holds, so writes are one ``index_copy_`` per layer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ferrollm.exceptions import ConfigError

__all__ = ["AttentionMetadata", "PrefillChunk", "StepRows", "allocate_kv_cache", "kv_cache_bytes_per_block",
           "step_tensor"]


class _StepArrays(Protocol):
    """The part of ``ferrollm.SchedulerOutput`` attention needs (a protocol, so tests may fake it)."""

    slot_mapping: np.ndarray
    block_tables: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    num_computed_tokens: np.ndarray


@dataclass
class AttentionMetadata:
    """Where one step's tokens sit in the paged KV cache.

    Row ``i`` of each per-request tensor is the ``i``-th scheduled request. Its query tokens are
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flat token batch, at context positions
    ``num_computed_tokens[i] .. seq_lens[i]-1``.

    Attributes:
        slot_mapping: int64 ``[num_tokens]``, flat KV slot each new token's K/V is written to.
        block_tables: int32 ``[num_reqs, max_blocks]``, block ids per request, padded with 0.
        query_start_loc: int32 ``[num_reqs + 1]``, cumulative query lengths.
        seq_lens: int32 ``[num_reqs]``, context length after this step.
        num_computed_tokens: int32 ``[num_reqs]``, tokens already in the cache before this step.
        num_reqs: number of scheduled requests.
        num_tokens: number of scheduled tokens.
        max_query_len: longest query of the step (1 for a decode-only step).
        max_seq_len: longest context of the step.
        block_size: tokens per KV block.
        image_spans: ``(request row, start, end)`` context positions of the images this step
            schedules, for models that attend bidirectionally inside an image (Gemma 3); None
            for the others (see ``attention/image_spans.py``).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_computed_tokens: torch.Tensor
    num_reqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    image_spans: list[tuple[int, int, int]] | None = None

    @property
    def is_decode_only(self) -> bool:
        """True when every request has exactly one query token."""
        return self.max_query_len == 1

    @functools.cached_property
    def rows(self) -> StepRows:
        """The step's requests split by kind, once per step: every layer of a mixed step reads
        the split, and working it out again per layer (a diff, two searches, three host lists)
        cost ~0.25 ms a layer on the CPU."""
        return StepRows.of(self)

    @classmethod
    def from_step(
        cls, step: _StepArrays, block_size: int, device: torch.device | str = "cpu"
    ) -> AttentionMetadata:
        """Wraps a step's arrays without copying them on the CPU.

        Args:
            step: a ``ferrollm.SchedulerOutput`` (or anything with the same array attributes).
            block_size: tokens per KV block, as configured in the engine core.
            device: where the model runs; CPU tensors share memory with the numpy arrays.

        Returns:
            The step's metadata.
        """
        query_start_loc = np.asarray(step.query_start_loc)
        seq_lens = np.asarray(step.seq_lens)
        num_reqs = len(seq_lens)
        query_lens = np.diff(query_start_loc)
        device = torch.device(device)

        def wrap(a: np.ndarray) -> torch.Tensor:
            return step_tensor(a, device, non_blocking=True)

        return cls(
            slot_mapping=wrap(step.slot_mapping),
            block_tables=wrap(step.block_tables),
            query_start_loc=wrap(query_start_loc),
            seq_lens=wrap(seq_lens),
            num_computed_tokens=wrap(step.num_computed_tokens),
            num_reqs=num_reqs,
            num_tokens=int(query_start_loc[-1]) if num_reqs else 0,
            max_query_len=int(query_lens.max()) if num_reqs else 0,
            max_seq_len=int(seq_lens.max()) if num_reqs else 0,
            block_size=block_size,
        )


class PrefillChunk(NamedTuple):
    """One request's query chunk of more than one token: its row, its tokens ``start:end`` in the
    flat batch, its context length after the step and the tokens cached before it."""

    row: int
    start: int
    end: int
    seq_len: int
    num_computed: int


@dataclass(frozen=True)
class StepRows:
    """A step's decode rows (one query token each, batched together) and prefill chunks (run
    one request at a time).

    Attributes:
        decode_tokens: int64 ``[num_decodes]`` the token of each row with one query token, by
            its index in the flat batch.
        decode_seq_lens: their context lengths.
        decode_block_tables: their block tables.
        decode_max_seq_len: the longest of their contexts (0 with none).
        prefills: the other rows' chunks, in row order.
    """

    decode_tokens: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_max_seq_len: int
    prefills: tuple[PrefillChunk, ...]

    @classmethod
    def of(cls, meta: AttentionMetadata) -> StepRows:
        starts = meta.query_start_loc.tolist()
        seq_lens, computed = meta.seq_lens.tolist(), meta.num_computed_tokens.tolist()
        lengths = [end - start for start, end in zip(starts, starts[1:])]
        decodes = [row for row, n in enumerate(lengths) if n == 1]
        index = torch.tensor(decodes, dtype=torch.int64, device=meta.seq_lens.device)
        prefills = tuple(PrefillChunk(row, starts[row], starts[row + 1], seq_lens[row], computed[row])
                         for row, n in enumerate(lengths) if n > 1)
        return cls(decode_tokens=meta.query_start_loc[index].long(),
                   decode_seq_lens=meta.seq_lens[index],
                   decode_block_tables=meta.block_tables[index],
                   decode_max_seq_len=max((seq_lens[row] for row in decodes), default=0),
                   prefills=prefills)


def step_tensor(array: np.ndarray, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """A step array as a tensor on ``device``: on the CPU the array's own memory, with no `.to`
    (a call that does nothing still costs a dispatch, several times a step)."""
    t = torch.from_numpy(array)
    return t if device.type == "cpu" else t.to(device, non_blocking=non_blocking)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes one KV block takes across all layers (keys and values).

    Args:
        num_layers: attention layers holding a KV cache.
        block_size: tokens per block.
        num_kv_heads: KV heads on this rank.
        head_dim: size of one head.
        dtype: KV cache element type.

    Returns:
        The size in bytes.
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Allocates one zeroed KV cache tensor per layer.

    Zeroed rather than empty so that block 0 (the null block padding ``block_tables``) never holds
    NaN/inf garbage that a masked-out score could still multiply into an output.

    Args:
        num_layers: attention layers.
        num_blocks: blocks per layer, the same count the engine core manages.
        block_size: tokens per block.
        num_kv_heads: KV heads on this rank.
        head_dim: size of one head.
        dtype: element type.
        device: where to allocate.

    Returns:
        ``num_layers`` tensors shaped ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

    Raises:
        ConfigError: if a size is not positive.
    """
    sizes = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                 num_kv_heads=num_kv_heads, head_dim=head_dim)
    for name, value in sizes.items():
        if value <= 0:
            raise ConfigError(f"`{name}` must be > 0. Given: {value}")
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        return [_lazy_zeros(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the OS zero-fills on first touch (numpy's calloc), so a
    multi-GiB cache costs nothing at start-up and resident memory follows what is used.
    `torch.zeros` writes every byte up front: about 3 s per 4 GiB on a 2-core machine."""
    import numpy as np

    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
