"""The runner's multimodal work for one step: M-RoPE positions and the image embeddings of the
scheduled placeholder rows.

Each request with images keeps, in its `RequestMultiModal`, its items, its M-RoPE table and the
encoder outputs of images whose placeholders are not all computed yet. A step encodes, in one
encoder call, every image whose placeholders it schedules and whose output is not kept; so a
chunked prefill that splits an image's placeholders across steps reuses the kept output, and an
image entirely inside a prefix-cache hit is never encoded. An output is dropped once its last
placeholder is computed (a preempted request re-encodes it when it recomputes).

Costs: Python work per request with images in the step (not per token); the encoder's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ferrollm.multimodal.inputs import MultiModalInputs

__all__ = ["RequestMultiModal", "image_spans", "prepare_multimodal_step"]


@dataclass
class RequestMultiModal:
    """A request's multimodal state in the runner.

    Attributes:
        inputs: the processed prompt and items.
        positions: int64 ``[3, prompt_len]`` M-RoPE positions (None for 1-D RoPE models).
        delta: what tokens past the prompt add to their index (M-RoPE).
        encoder_outputs: item index -> ``[length, hidden]`` embeddings not yet fully consumed.
    """

    inputs: MultiModalInputs
    positions: np.ndarray | None = None
    delta: int = 0
    encoder_outputs: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def create(cls, model, inputs: MultiModalInputs) -> RequestMultiModal:
        state = cls(inputs)
        if hasattr(model, "mrope_positions"):
            state.positions, state.delta = model.mrope_positions(len(inputs.prompt_token_ids), inputs.items)
        return state

    def step_positions(self, flat: np.ndarray) -> np.ndarray:
        """``[3, n]`` positions of this request's scheduled token indices ``flat``."""
        assert self.positions is not None
        prompt_len = self.positions.shape[1]
        in_prompt = flat < prompt_len
        out = np.broadcast_to(flat + self.delta, (3, len(flat))).copy()
        out[:, in_prompt] = self.positions[:, flat[in_prompt]]
        return out


def prepare_multimodal_step(model, step, mm_states: list[RequestMultiModal | None], device: torch.device):
    """The step's positions (``[3, n]`` when the model uses M-RoPE and a request has images,
    else the core's 1-D array) and ``(rows, embeds)`` of the scheduled image placeholders (or
    None). ``mm_states`` has one entry per scheduled request, None for text-only ones."""
    positions = step.positions
    if not any(s is not None for s in mm_states):
        return torch.from_numpy(positions).to(device), None
    qsl = step.query_start_loc
    computed, scheduled = step.num_computed_tokens, step.num_scheduled_tokens
    uses_mrope = hasattr(model, "mrope_positions")
    if uses_mrope:
        positions = np.broadcast_to(positions, (3, len(positions))).copy()
    wanted: list[tuple[int, int, int, int]] = []  # (request row, item, first row, item offset)
    for row, state in enumerate(mm_states):
        if state is None:
            continue
        lo, hi = int(qsl[row]), int(qsl[row + 1])
        if uses_mrope:
            positions[:, lo:hi] = state.step_positions(step.positions[lo:hi])
        start, end = int(computed[row]), int(computed[row]) + int(scheduled[row])
        for k, item in enumerate(state.inputs.items):
            first, last = max(item.offset, start), min(item.offset + item.length, end)
            if first < last:
                wanted.append((row, k, lo + first - start, first - item.offset))
    embeds = _gather_embeds(model, mm_states, wanted, computed, scheduled, device)
    return torch.from_numpy(np.ascontiguousarray(positions)).to(device), embeds


def image_spans(step, mm_states: list[RequestMultiModal | None]) -> list[tuple[int, int, int]]:
    """``(request row, start, end)`` context positions of every image whose placeholders the
    step schedules, for models that attend bidirectionally inside an image."""
    spans = []
    computed, scheduled = step.num_computed_tokens, step.num_scheduled_tokens
    for row, state in enumerate(mm_states):
        if state is None:
            continue
        start, end = int(computed[row]), int(computed[row]) + int(scheduled[row])
        spans.extend((row, it.offset, it.offset + it.length) for it in state.inputs.items
                     if it.offset < end and it.offset + it.length > start)
    return spans


def _gather_embeds(model, mm_states, wanted, computed, scheduled, device):
    if not wanted:
        return None
    _encode_missing(model, mm_states, wanted, device)
    rows, values = [], []
    for row, k, first_row, item_start in wanted:
        state = mm_states[row]
        item = state.inputs.items[k]
        end = int(computed[row]) + int(scheduled[row])
        n = min(item.offset + item.length, end) - (item.offset + item_start)
        out = state.encoder_outputs[k]
        rows.append(torch.arange(first_row, first_row + n))
        values.append(out[item_start : item_start + n])
        if item.offset + item.length <= end:
            del state.encoder_outputs[k]  # every placeholder of the item is now computed
    return torch.cat(rows).to(device), torch.cat(values)


def _encode_missing(model, mm_states, wanted, device) -> None:
    """One encoder call over every wanted item whose output is not kept."""
    todo = []
    for row, k, _, _ in wanted:
        state = mm_states[row]
        if k not in state.encoder_outputs and (row, k) not in todo:
            todo.append((row, k))
    if not todo:
        return
    items = [mm_states[row].inputs.items[k] for row, k in todo]
    pixels = torch.cat([it.pixel_values for it in items]).to(device)
    outputs = model.encode_images(pixels, [it.grid for it in items])
    for (row, k), out in zip(todo, outputs):
        mm_states[row].encoder_outputs[k] = out
