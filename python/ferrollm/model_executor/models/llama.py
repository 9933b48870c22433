"""Llama, and the pieces the decoder-only checkpoints built like it reuse.

Parameter names follow HF's after fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``,
so ``load_weights`` takes HF checkpoint names.

A model that differs from Llama only in per-layer details (biases, attention scale, sliding
windows, soft-capping, q/k norms, activation, norm flavour, residual scaling) subclasses
:class:`LlamaForCausalLM` and overrides :meth:`LlamaForCausalLM.layer_options`; one with another
block layout also sets ``decoder_layer_cls``. The hooks ``embedding_scale`` and ``compute_logits``
cover scaled embeddings and post-processed logits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.layer import Attention
from ferrollm.kernels.cpu.decoder import CpuDecoder, build_cpu_decoder
from ferrollm.model_executor.layers.activation import SiluAndMul, get_act_and_mul
from ferrollm.model_executor.layers.cpu_gemm import MLP_SLAB_ROWS, row_slabs
from ferrollm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ferrollm.model_executor.layers.norm import RMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding, get_rope, rope_max_position, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["LayerOptions", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP",
           "LlamaModel", "head_dim_of"]


def head_dim_of(config: PretrainedConfig) -> int:
    """``config.head_dim`` when set, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class LayerOptions:
    """How one decoder layer is built.

    Attributes:
        rope: RoPE settings, from :func:`rope_parameters` (layers with equal settings share one
            cos/sin table).
        qkv_bias: biases on q, k and v.
        o_bias: bias on the output projection.
        mlp_bias: biases on the MLP projections.
        hidden_act: the gated MLP's activation, by its HF name.
        norm: the norm class of the layer (and of q/k when ``qk_norm``).
        scale: attention score multiplier; ``None`` means ``head_dim ** -0.5``.
        sliding_window: attend to the last ``sliding_window`` positions only.
        logits_soft_cap: soft-cap attention scores with ``cap * tanh(score / cap)``.
        qk_norm: normalise every q and k head over ``head_dim`` before the rotary embedding.
        residual_multiplier: scales the attention and MLP outputs before they join the residual.
    """

    rope: dict[str, Any]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    norm: type[RMSNorm] = RMSNorm
    scale: float | None = None
    sliding_window: int | None = None
    logits_soft_cap: float | None = None
    qk_norm: bool = False
    residual_multiplier: float = 1.0


class LlamaMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, params_dtype=dtype)
        self.act_fn = get_act_and_mul(hidden_act)
        # SiLU runs inside the CPU GEMM of gate/up, whose weight is then packed half by half.
        self.gate_up_proj.gated = isinstance(self.act_fn, SiluAndMul)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            # Long prefills in slabs whose intermediates stay in cache (see `cpu_gemm`).
            return row_slabs(self._mlp, x, MLP_SLAB_ROWS)
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gated = self.gate_up_proj.silu_and_mul(x)
        if gated is None:
            gated = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(gated)


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, optional per-head q/k norms, rotary embedding, paged
    attention, output projection."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, opts: LayerOptions,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, opts.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        opts.o_bias, params_dtype=dtype)
        self.rotary_emb = rotary_emb
        if opts.qk_norm:
            self.q_norm = opts.norm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = opts.norm(self.head_dim, config.rms_norm_eps, dtype)
        self.qk_norm = opts.qk_norm
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        scale = self.head_dim**-0.5 if opts.scale is None else opts.scale
        self.attn = Attention(self.qkv_proj.num_heads, self.head_dim, scale, self.qkv_proj.num_kv_heads,
                              opts.sliding_window, opts.logits_soft_cap)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            q = self.q_norm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_norm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is passed along separately so the norms fuse the add."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, opts: LayerOptions,
                 rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, dtype, opts, rotary_emb)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, opts.hidden_act,
                            opts.mlp_bias, dtype)
        self.input_layernorm = opts.norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = opts.norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.residual_multiplier = opts.residual_multiplier

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self._scaled(self.self_attn(positions, hidden_states, kv_cache, attn_metadata))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self._scaled(self.mlp(hidden_states)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_multiplier == 1.0 else x * self.residual_multiplier


class LlamaModel(nn.Module):
    """Embedding (optionally scaled), decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, layers: Iterable[nn.Module],
                 norm: nn.Module, embed_scale: float | None = None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.embed_scale = embed_scale
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        # Multimodal models pass the embeddings already scaled, with their images' rows merged in
        # (Gemma 3 scales the text rows only).
        hidden_states = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        decoder = self._cpu_decoder_for(hidden_states, kv_caches, attn_metadata)
        if decoder is not None:  # the final norm included
            return decoder.run(hidden_states, positions, kv_caches, attn_metadata)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, scaled where the model scales them."""
        hidden_states = self.embed_tokens(input_ids)
        return hidden_states if self.embed_scale is None else hidden_states * self.embed_scale

    # The one-call CPU decoder (`kernels.cpu.decoder`), built at the first CPU decode step: False
    # until then, None where the layers need the layer path.
    _cpu_decoder: CpuDecoder | None | bool = False
    # The causal LM's head, which the decoder samples tokens from (`LlamaForCausalLM.
    # sample_tokens`); held in a tuple, as a submodule its parameters would be listed twice.
    _decoder_head: tuple[nn.Module, ...] = ()

    def _cpu_decoder_for(self, hidden_states: torch.Tensor, kv_caches: list[torch.Tensor],
                         attn_metadata: AttentionMetadata) -> CpuDecoder | None:
        """The one-call decoder where this step can take it: a CPU step without images, of decode
        rows with or without prompt chunks (`CpuDecoder.takes_step`), run eagerly (a compiled
        model reads its metadata from the forward context, and is None here)."""
        if attn_metadata is None or not hidden_states.is_cpu or torch.compiler.is_compiling():
            return None
        if attn_metadata.image_spans:
            return None
        if self._cpu_decoder is False:
            if not attn_metadata.is_decode_only:
                return None  # built at the first decode step, as the log line says
            self._cpu_decoder = build_cpu_decoder(self, *self._decoder_head)
        decoder = self._cpu_decoder
        if (isinstance(decoder, CpuDecoder) and decoder.takes_step(attn_metadata)
                and decoder.takes(hidden_states, kv_caches)):
            return decoder
        return None


class LlamaForCausalLM(CausalLMInterface, nn.Module):
    """Llama decoder with an LM head.

    Args:
        config: the HF config (``LlamaConfig`` or compatible).
        dtype: parameter and activation dtype.
    """

    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = head_dim_of(config)
        options = [self.layer_options(config, i) for i in range(self.num_layers)]
        self.sliding_windows = [opts.sliding_window for opts in options]
        ropes: dict[str, RotaryEmbedding] = {}
        layers = [self.decoder_layer_cls(config, dtype, opts, self._rope(opts.rope, ropes))
                  for opts in options]
        norm = self.norm_cls(config.hidden_size, config.rms_norm_eps, dtype)
        self.model = LlamaModel(config, dtype, layers, norm, self.embedding_scale(config, dtype))
        # Per rank: the KV cache is allocated for the heads this rank holds.
        self.num_kv_heads = cast(LlamaAttention, layers[0].self_attn).qkv_proj.num_kv_heads if layers else 0
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.model._decoder_head = (self.lm_head,)

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        """How layer ``layer_idx`` is built; subclasses adjust this with ``dataclasses.replace``."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LayerOptions(rope=rope_parameters(config), qkv_bias=attention_bias, o_bias=attention_bias,
                            mlp_bias=bool(getattr(config, "mlp_bias", False)),
                            hidden_act=getattr(config, "hidden_act", "silu"), norm=cls.norm_cls)

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype) -> float | None:
        """Multiplier of the token embeddings, or ``None`` for none."""
        return None

    def _rope(self, params: dict[str, Any], ropes: dict[str, RotaryEmbedding]) -> RotaryEmbedding:
        # One cos/sin table per distinct setting, shared by the layers: a 128k-position table of a
        # 256-wide head is 128 MiB in float32.
        key = repr(sorted(params.items()))
        if key not in ropes:
            ropes[key] = get_rope(self.head_dim, rope_max_position(self.config), params,
                                  dtype=self.dtype)
        return ropes[key]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step.

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``.
            kv_caches: one tensor per layer, from ``allocate_kv_cache``.
            attn_metadata: the step's metadata.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]``.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def sample_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                      attn_metadata: AttentionMetadata,
                      uniforms: Callable[[], torch.Tensor] | None) -> torch.Tensor | None:
        """Each row's token (int64 ``[num_tokens]``) of a decode step, the LM head and the draw in
        the one-call CPU decoder's call (`CpuDecoder.sample`: greedy, or at the numbers
        ``uniforms()`` gives, asked only once the decoder takes the step, so a step it does not
        take draws nothing from the generators); None where it does not, and the caller runs
        `forward` and samples as usual. The caller checks that nothing edits the rows' logits."""
        built = self.model._cpu_decoder  # False until the first decode step builds it
        if not attn_metadata.is_decode_only or built is None or (built and not built.holds_lm_head):
            return None  # known before embedding: `forward` would look the rows up again
        hidden_states = self.model.embed(input_ids)
        decoder = self.model._cpu_decoder_for(hidden_states, kv_caches, attn_metadata)
        if decoder is None or not decoder.holds_lm_head:
            return None
        return decoder.sample(hidden_states, positions, kv_caches, attn_metadata,
                              None if uniforms is None else uniforms())

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF checkpoint's tensors by name.

        Args:
            weights: ``(hf_name, tensor)`` pairs, e.g. from ``iterate_safetensors``.

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        skip = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            # Some tied checkpoints still store a copy of the embedding as lm_head.
            skip += ("lm_head.",)
        return load_weights_into(self, weights, self.stacked_params_mapping, skip)
