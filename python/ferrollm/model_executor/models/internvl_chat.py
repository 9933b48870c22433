"""InternVL in OpenGVLab's own layout (``InternVLChatModel``, remote code on the hub: InternVL2,
e.g. InternVL2-2B with an InternLM2 text model). The network is the -hf one
(:class:`InternVLForConditionalGeneration`: InternViT, pixel shuffle ``ps_version`` v2, a
LayerNorm/linear/GELU/linear projector, a causal decoder); only the names differ, and they are
translated at load:

- ``vision_model.embeddings.{class_embedding, patch_embedding, position_embedding}`` ->
  ``embeddings.{cls_token, patch_embeddings.projection, position_embeddings}``;
  ``vision_model.encoder.layers.N.*``: ``attn.qkv`` (q, k, v stacked, split here) ->
  ``attention.{q,k,v}_proj``, ``attn.proj`` -> ``attention.projection_layer``, ``attn.q_norm``/
  ``k_norm`` as they are, ``norm1``/``norm2`` -> ``layernorm_before``/``layernorm_after``,
  ``ls1``/``ls2`` -> ``lambda_1``/``lambda_2``, ``mlp.fc1/fc2`` as they are. InternViT has no
  final norm (the config says ``use_mean_pooling``).
- ``mlp1.0`` / ``mlp1.1`` / ``mlp1.3`` -> the projector's ``layer_norm`` / ``linear_1`` / ``linear_2``.
- ``language_model.*``: an InternLM2 (``model.tok_embeddings``, ``output``, fused ``wqkv``; see
  ``internlm2.py``), or a Llama/Qwen2 under its HF names.

The config is built by `ferrollm.config.remote_configs` (no remote code runs); images are tiled
by `ferrollm.multimodal.internvl_processor.InternVLChatMultiModalProcessor`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ferrollm.model_executor.models.internlm2 import InternLM2ForCausalLM, internlm2_to_llama
from ferrollm.model_executor.models.internvl import _TEXT_MODELS, InternVLForConditionalGeneration

__all__ = ["InternVLChatModel"]

_VISION_RENAMES = (
    ("embeddings.class_embedding", "embeddings.cls_token"),
    ("embeddings.patch_embedding.", "embeddings.patch_embeddings.projection."),
    ("embeddings.position_embedding", "embeddings.position_embeddings"),
    ("encoder.layers.", "encoder.layer."),
    (".attn.proj.", ".attention.projection_layer."),
    (".attn.q_norm.", ".attention.q_norm."),
    (".attn.k_norm.", ".attention.k_norm."),
    (".norm1.", ".layernorm_before."),
    (".norm2.", ".layernorm_after."),
    (".ls1", ".lambda_1"),
    (".ls2", ".lambda_2"),
)
_PROJECTOR = {"mlp1.0.": "layer_norm.", "mlp1.1.": "linear_1.", "mlp1.3.": "linear_2."}


def vision_names(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """One ``vision_model.*`` tensor (prefix removed) under the -hf vision tower's names."""
    for old, new in _VISION_RENAMES:
        name = name.replace(old, new)
    if ".attn.qkv." in name:  # rows: all q heads, then all k, then all v
        for part, piece in zip("qkv", tensor.chunk(3, dim=0)):
            yield name.replace(".attn.qkv.", f".attention.{part}_proj."), piece
        return
    yield name, tensor


class InternVLChatModel(InternVLForConditionalGeneration):
    """OpenGVLab's InternVL (``InternVLChatModel``): InternViT + pixel shuffle + ``mlp1`` + an
    InternLM2, Qwen2 or Llama decoder.

    Args:
        config: an ``InternVLChatConfig`` (`ferrollm.config.remote_configs`).
        dtype: parameter and activation dtype.

    Raises:
        CheckpointError: a text model other than InternLM2, Qwen2 or Llama.
    """

    text_models = {**_TEXT_MODELS, "internlm2": InternLM2ForCausalLM}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads OpenGVLab's names (see the module docstring) through the -hf loader."""
        return super().load_weights(self._hf_names(weights))

    def _hf_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        internlm2 = isinstance(self.language_model, InternLM2ForCausalLM)
        text_config = self.config.get_text_config()
        for name, tensor in weights:
            if name.startswith("vision_model.") and self.vision_tower is None:
                yield "vision_tower." + name, tensor  # skipped (and counted) as it is
            elif name.startswith("vision_model."):
                for hf_name, piece in vision_names(name.removeprefix("vision_model."), tensor):
                    yield "vision_tower." + hf_name, piece
            elif name.startswith(tuple(_PROJECTOR)):
                prefix = name[:len("mlp1.0.")]
                yield "multi_modal_projector." + _PROJECTOR[prefix] + name.removeprefix(prefix), tensor
            elif internlm2 and name.startswith("language_model."):
                one = [(name.removeprefix("language_model."), tensor)]
                for llama_name, piece in internlm2_to_llama(one, text_config):
                    yield "language_model." + llama_name, piece
            else:
                yield name, tensor
