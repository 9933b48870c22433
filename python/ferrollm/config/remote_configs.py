"""Configs of checkpoints whose ``config.json`` names remote code (``auto_map``), which
``AutoConfig`` loads only with ``trust_remote_code``: ferrollm builds them from the JSON itself,
so no code from the checkpoint runs.

- ``internlm2`` (``InternLM2ForCausalLM``): Llama's fields plus ``bias`` (on ``wqkv`` and ``wo``).
- ``internvl_chat`` (``InternVLChatModel``, OpenGVLab's InternVL layout): an InternViT
  ``vision_config`` (``intern_vit_6b``) and an ``llm_config`` (InternLM2, Llama or Qwen2). It is
  presented under transformers' InternVL names (``vision_config`` as ``InternVLVisionConfig``,
  ``text_config``, ``image_token_id``, ``image_seq_length``, ...) so the -hf model code reads it;
  the tiling fields (``min/max_dynamic_patch``, ``use_thumbnail``, ``dynamic_image_size``) stay.

Any other ``model_type`` goes to ``AutoConfig`` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from ferrollm.exceptions import ConfigError

__all__ = ["InternLM2Config", "InternVLChatConfig", "added_token_id", "load_hf_config"]

IMG_CONTEXT = "<IMG_CONTEXT>"
_CHAT_TEXT_ARCHS = ("InternLM2ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM")


class InternLM2Config(PretrainedConfig):
    """InternLM2's config, with the defaults of its ``configuration_internlm2.py`` (``bias`` True)."""

    model_type = "internlm2"

    def __init__(self, vocab_size: int = 103168, hidden_size: int = 4096, intermediate_size: int = 11008,
                 num_hidden_layers: int = 32, num_attention_heads: int = 32, num_key_value_heads: int | None = None,
                 hidden_act: str = "silu", max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-6,
                 bias: bool = True, rope_theta: float = 10000.0, rope_scaling: dict | None = None,
                 tie_word_embeddings: bool = False, **kwargs: Any):
        self.vocab_size, self.hidden_size, self.intermediate_size = vocab_size, hidden_size, intermediate_size
        self.num_hidden_layers, self.num_attention_heads = num_hidden_layers, num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.hidden_act, self.max_position_embeddings, self.rms_norm_eps = hidden_act, max_position_embeddings, rms_norm_eps
        self.bias = bool(bias)
        # transformers 5's single RoPE dict (``rope_scaling`` is deprecated there); the remote
        # config's ``type`` key becomes ``rope_type``.
        scaling = dict(rope_scaling or {})
        rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
        self.rope_parameters = {**scaling, "rope_type": rope_type, "rope_theta": rope_theta}
        # A runtime choice of the remote code (eager / flash), not a property of the weights.
        kwargs.pop("attn_implementation", None)
        kwargs.pop("auto_map", None)
        super().__init__(**kwargs)
        self.tie_word_embeddings = bool(tie_word_embeddings)


def _internlm2_config(values: dict[str, Any]) -> InternLM2Config:
    version = values.get("rope_pos_id_version", "default")
    if version != "default":
        raise ConfigError(f"InternLM2's `rope_pos_id_version` must be 'default' (V2PE positions are not supported). "
                          f"Given: {version!r}")
    if values.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"InternLM2's `hidden_act` must be 'silu'. Given: {values['hidden_act']!r}")
    return InternLM2Config(**values)


class InternVLChatConfig(PretrainedConfig):
    """``InternVLChatModel``'s config under transformers' InternVL attribute names; built by
    :func:`internvl_chat_config`."""

    model_type = "internvl_chat"


def _text_config(values: dict[str, Any]) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen2Config

    arch = (values.get("architectures") or [None])[0]
    if arch not in _CHAT_TEXT_ARCHS:
        raise ConfigError(f"InternVLChatModel's `llm_config.architectures` must be one of {list(_CHAT_TEXT_ARCHS)}. "
                          f"Given: {values.get('architectures')!r}")
    values = {k: v for k, v in values.items() if k not in ("auto_map", "attn_implementation", "model_type")}
    if arch == "InternLM2ForCausalLM":
        return _internlm2_config(values)
    return (LlamaConfig if arch == "LlamaForCausalLM" else Qwen2Config)(**values)


def _vision_config(values: dict[str, Any], image_size: int):
    """OpenGVLab's InternViT fields as transformers' ``InternVLVisionConfig``: no final norm
    (``use_mean_pooling``), as InternViT has none."""
    from transformers import InternVLVisionConfig

    patch = int(values.get("patch_size", 14))
    return InternVLVisionConfig(
        hidden_size=values["hidden_size"], intermediate_size=values["intermediate_size"],
        num_hidden_layers=values["num_hidden_layers"], num_attention_heads=values["num_attention_heads"],
        num_channels=values.get("num_channels", 3), image_size=[image_size, image_size], patch_size=[patch, patch],
        hidden_act=values.get("hidden_act", "gelu"), layer_norm_eps=values.get("layer_norm_eps", 1e-6),
        norm_type=values.get("norm_type", "rms_norm"), attention_bias=bool(values.get("qkv_bias", False)),
        use_qk_norm=bool(values.get("qk_normalization", True)), use_mean_pooling=True,
        use_absolute_position_embeddings=True)


def internvl_chat_config(values: dict[str, Any], folder: Path) -> InternVLChatConfig:
    """``InternVLChatModel``'s config; ``image_token_id`` is the tokenizer's ``<IMG_CONTEXT>``, as
    the model's ``chat`` looks it up.

    Raises:
        ConfigError: an unsupported text model, ``ps_version`` other than ``"v2"``, a
            ``force_image_size`` unlike the vision tower's, or no ``<IMG_CONTEXT>`` token.
    """
    vision, llm = dict(values.get("vision_config") or {}), dict(values.get("llm_config") or {})
    image_size = int(values.get("force_image_size") or vision.get("image_size", 224))
    if image_size != int(vision.get("image_size", image_size)):
        raise ConfigError(f"InternVLChatModel's `force_image_size` must equal vision_config.image_size "
                          f"({vision['image_size']}; resized position tables are not supported). Given: {image_size}")
    if values.get("ps_version", "v1") != "v2":
        raise ConfigError(f"InternVLChatModel's `ps_version` must be 'v2' (v1's transposed pixel shuffle is not "
                          f"supported). Given: {values.get('ps_version', 'v1')!r}")
    text = _text_config(llm)
    ratio = float(values.get("downsample_ratio", 0.5))
    patch = int(vision.get("patch_size", 14))
    known = ("vision_config", "llm_config", "architectures", "auto_map", "model_type")
    extra = {k: v for k, v in values.items() if k not in known}
    extra.setdefault("tie_word_embeddings", bool(getattr(text, "tie_word_embeddings", False)))
    config = InternVLChatConfig(**extra)
    config.architectures = ["InternVLChatModel"]
    config.text_config = text
    config.vision_config = _vision_config(vision, image_size)
    config.downsample_ratio = ratio
    config.image_seq_length = int((image_size // patch) ** 2 * ratio**2)
    config.image_token_id = _image_token_id(folder)
    config.projector_hidden_act = "gelu"
    config.vision_feature_layer = int(values.get("select_layer", -1))
    config.vision_feature_select_strategy = "default"
    for key, default in (("min_dynamic_patch", 1), ("max_dynamic_patch", 6), ("use_thumbnail", False),
                         ("dynamic_image_size", False)):
        setattr(config, key, values.get(key, default))
    return config


def _image_token_id(folder: Path) -> int:
    ident = added_token_id(folder, IMG_CONTEXT)
    if ident is None:
        raise ConfigError(f"InternVLChatModel's tokenizer in {folder} must have the added token {IMG_CONTEXT!r} "
                          "(tokenizer.json or tokenizer_config.json)")
    return ident


def added_token_id(folder: Path, content: str) -> int | None:
    """``content``'s id among the added tokens of ``tokenizer.json`` (or ``tokenizer_config.json``),
    read from the files: ``AutoTokenizer`` would ask to run InternVL2's remote tokenizer code."""
    for name, key in (("tokenizer.json", "added_tokens"), ("tokenizer_config.json", "added_tokens_decoder")):
        path = folder / name
        if not path.is_file():
            continue
        added = json.loads(path.read_text()).get(key) or []
        entries = added.items() if isinstance(added, dict) else ((t.get("id"), t) for t in added)
        for ident, token in entries:
            if token.get("content") == content:
                return int(ident)
    return None


def load_hf_config(folder: Path) -> PretrainedConfig:
    """The checkpoint's config: built here for ``internlm2`` and ``internvl_chat``, else by
    ``AutoConfig``.

    Raises:
        ConfigError: an unreadable ``config.json``, an unknown ``model_type``, or an unsupported
            setting of the configs built here.
    """
    path = folder / "config.json"
    try:
        values = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not read {path}: {e}") from e
    model_type = values.get("model_type")
    if model_type == "internlm2":
        values.pop("model_type")
        return _internlm2_config(values)
    if model_type == "internvl_chat":
        return internvl_chat_config(values, folder)
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # an unknown model_type, or a field transformers refuses
        raise ConfigError(f"could not read {path}: {e}") from e
