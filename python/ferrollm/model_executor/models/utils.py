"""Helpers shared by the model implementations."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

import torch
from torch import nn

from ferrollm.exceptions import CheckpointError, UnsupportedModelError
from ferrollm.model_executor.kv_scales import apply_kv_scale
from ferrollm.model_executor.weight_utils import default_weight_loader

__all__ = ["CausalLMInterface", "layer_sliding_window", "load_weights_into"]

def with_engine_settings(text_config, config):
    """``text_config`` carrying the engine's settings (``_ferrollm_*``, e.g. max_model_len) that
    travel on a multimodal model's top-level ``config``: its decoder reads only its own."""
    for key, value in vars(config).items():
        if key.startswith("_ferrollm_"):
            setattr(text_config, key, value)
    return text_config


class LanguageModelDelegate:
    """The engine's model interface (see `CausalLMInterface`) of a multimodal model, answered by
    its `language_model`: the decoder owns the KV cache layout, windows and LM head."""

    language_model: nn.Module

    def adopt_decoder_shape(self) -> None:
        """Mirrors the decoder's layer count, KV heads, head size and LM head on the wrapper,
        where code written for text models reads them. (Windows are not copied: the engine asks
        `sliding_window_spec`, which the decoder answers.)"""
        lm = self.language_model
        self.num_layers, self.num_kv_heads, self.head_dim = lm.num_layers, lm.num_kv_heads, lm.head_dim
        self.lm_head = lm.lm_head

    def kv_cache_spec(self) -> tuple[int, int, int]:
        return self.language_model.kv_cache_spec()

    def sliding_window_spec(self) -> int | None:
        return self.language_model.sliding_window_spec()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def run_decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    attn_metadata, mm_embeds: tuple[torch.Tensor, torch.Tensor] | None,
                    embed: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The decoder's step with the image embeddings ``mm_embeds = (rows, embeds)`` written over
        the placeholder rows of the token embeddings (``embed``, default the decoder's table)."""
        model = self.language_model.model
        if mm_embeds is None:
            return model(input_ids, positions, kv_caches, attn_metadata)
        embeds = (embed or model.embed_tokens)(input_ids)
        rows, values = mm_embeds
        embeds[rows] = values.to(embeds.dtype)
        return model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=embeds)


class CausalLMInterface:
    """What the engine asks of every decoder beyond ``forward``: KV sizing, the sliding window
    when every layer shares one, and logits from the LM head.

    Subclasses set ``num_layers``, ``num_kv_heads`` (on this rank), ``head_dim`` and ``lm_head``,
    and ``sliding_windows`` (one entry per layer) when any layer slides.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    lm_head: nn.Module
    sliding_windows: Sequence[int | None] = ()

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads on this rank, head_dim)`` for sizing the KV cache."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    def sliding_window_spec(self) -> int | None:
        """The window when every layer slides with the same one (the engine may then free KV
        blocks that fell out of it); ``None`` when some layer attends to its whole context."""
        windows = set(self.sliding_windows)
        return windows.pop() if len(windows) == 1 else None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[num_rows, vocab_size]`` logits of the given hidden-state rows."""
        return self.lm_head.compute_logits(hidden_states)


# (fused parameter, checkpoint projection, shard id): checkpoints keep q/k/v and gate/up apart,
# the models fuse each group into one matmul. The shard id is passed to the parameter's
# weight_loader as is: "q"/"k"/"v", a projection index, or e.g. ("gate", expert) for stacked experts.
StackedParams = Sequence[tuple[str, str, Hashable]]


def load_weights_into(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_params: StackedParams,
    skip: tuple[str, ...] = (),
) -> set[str]:
    """Loads HF-named checkpoint tensors through each parameter's ``weight_loader``.

    Args:
        model: the model; its parameter names follow the HF names after fusing.
        weights: ``(name, tensor)`` pairs of the full checkpoint.
        stacked_params: how checkpoint names map onto fused parameters.
        skip: substrings of checkpoint names to ignore (e.g. ``rotary_emb.inv_freq``).
            KV cache scales (``*.k_scale``, ``*.v_scale``) go to the attention layers
            (`model_executor.kv_scales`).

    Returns:
        The names of the parameters loaded.

    Raises:
        CheckpointError: for a checkpoint tensor the model has no parameter for, or a parameter
            the checkpoint does not provide.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, Hashable]] = set()
    for name, tensor in weights:
        if any(s in name for s in skip) or apply_kv_scale(model, name, tensor):
            continue
        param_name, shard_id = _fused_name(name, stacked_params)
        param = params.get(param_name)
        if param is None:
            raise CheckpointError(
                f"checkpoint tensor {name!r} has no parameter in {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard_id is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard_id)
        loaded.add((param_name, shard_id))
    missing = sorted(_expected_parts(params, stacked_params) - loaded, key=str)
    if missing:
        raise CheckpointError(
            f"the checkpoint lacks {len(missing)} tensors, e.g. (parameter, shard) {missing[:5]}"
        )
    return {name for name, _ in loaded}


def _expected_parts(params: dict[str, nn.Parameter], stacked_params: StackedParams):
    """Every (parameter, shard id) a complete checkpoint fills; shard id None for unfused ones."""
    expected = set()
    for name, param in params.items():
        if getattr(param, "optional", False):  # a quantized layer's tensor checkpoints may omit
            continue
        shards = [sid for fused, _, sid in stacked_params if fused in name]
        expected.update((name, sid) for sid in shards or [None])
    return expected


def _fused_name(name: str, stacked_params: StackedParams) -> tuple[str, Hashable]:
    for fused, part, shard_id in stacked_params:
        if part in name:
            return name.replace(part, fused), shard_id
    return name, None


_LAYER_TYPES = ("full_attention", "sliding_attention")


def layer_sliding_window(config, layer_idx: int, slides_without_layer_types: bool) -> int | None:
    """``config.sliding_window`` if layer ``layer_idx`` slides, else ``None``.

    Recent configs list every layer's type in ``layer_types``; for older ones the model's own
    rule decides, passed as ``slides_without_layer_types``.

    Raises:
        UnsupportedModelError: for a layer type other than full or sliding attention.
    """
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        slides = slides_without_layer_types
    else:
        if layer_types[layer_idx] not in _LAYER_TYPES:
            raise UnsupportedModelError(
                f"layer_types[{layer_idx}] = {layer_types[layer_idx]!r} is not supported; "
                f"supported: {list(_LAYER_TYPES)}"
            )
        slides = layer_types[layer_idx] == "sliding_attention"
    return config.sliding_window if slides else None
