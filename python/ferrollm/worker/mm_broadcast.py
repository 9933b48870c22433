"""A multimodal step's inputs from the driver to the other tensor-parallel ranks.

The requests' images reach the driver only (the core's step channel carries token arrays, not
pixels), so with ``tensor_parallel_size`` > 1 the driver alone runs the encoder, as it alone
keeps the requests' multimodal state (M-RoPE tables, kept encoder outputs). Every step of a
multimodal model it then broadcasts what the decoder needs beyond the core's arrays: the
positions when they are M-RoPE's ``[3, n]``, the placeholder rows and their embeddings, and the
image spans of models that attend both ways inside an image. A small header says which, so a
text-only step costs one broadcast of five integers.

The vision tower's weights are replicated (plain ``nn.Linear``s), so any rank could encode; the
driver doing it once keeps the encoder's cost off the others.
"""

from __future__ import annotations

import torch

from ferrollm.distributed.parallel_state import get_tensor_model_parallel_rank, tensor_model_parallel_broadcast

__all__ = ["broadcast_multimodal_step"]

# Embedding dtypes by the index the header carries.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Embeds = tuple[torch.Tensor, torch.Tensor] | None
Spans = list[tuple[int, int, int]] | None


def broadcast_multimodal_step(positions: torch.Tensor, embeds: Embeds, spans: Spans,
                              device: torch.device) -> tuple[torch.Tensor, Embeds, Spans]:
    """The driver's ``(positions, embeds, spans)`` on every rank.

    Args:
        positions: ``[n]`` or ``[3, n]`` int64; on the other ranks the core's ``[n]`` positions
            (replaced when the driver's are ``[3, n]``).
        embeds: ``(rows, values)`` of the scheduled placeholders (driver), else None.
        spans: ``(request row, start, end)`` of the step's images (driver), else None.
        device: where the collectives run (the model's device).
    """
    driver = get_tensor_model_parallel_rank() == 0
    header = torch.zeros(5, dtype=torch.int64)
    if driver:
        rows, values = embeds if embeds is not None else (None, None)
        header[:] = torch.tensor([positions.dim(), 0 if rows is None else len(rows),
                                  0 if values is None else values.shape[1], len(spans or ()),
                                  0 if values is None else _DTYPES.index(values.dtype)])
    pos_dims, n_rows, width, n_spans, dtype = _shared(header, device).tolist()
    n_tokens = positions.shape[-1]
    if pos_dims == 2:
        positions = _shared(positions if driver else torch.empty((3, n_tokens), dtype=torch.int64), device)
    if n_rows:
        if driver and embeds is not None:
            rows, values = embeds
        else:
            rows, values = torch.empty(n_rows, dtype=torch.int64), torch.empty((n_rows, width), dtype=_DTYPES[dtype])
        embeds = (_shared(rows, device), _shared(values, device))
    if n_spans:
        table = torch.tensor(spans if driver else [[0, 0, 0]] * n_spans, dtype=torch.int64)
        spans = [tuple(s) for s in _shared(table, device).tolist()]  # type: ignore[misc]
    return positions, embeds, spans


def _shared(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor_model_parallel_broadcast(x.contiguous().to(device))
