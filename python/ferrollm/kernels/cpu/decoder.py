"""Decode steps through a whole Llama-shaped decoder stack in one Rust call
(``rust/kernels/src/decoder.rs``).

The layer-by-layer path calls a kernel per op from Python (~10 per layer). On quantized weights at
batch 1 the kernels' work is small, and that glue took about half of a step (SmolLM2-135M Q4_1,
2 threads); the OpenMP team also fell asleep between kernels, so every product paid a wake-up.
:func:`build_cpu_decoder` describes the model's layers to the Rust core once, at the first decode
step; each step of decode rows, prompt chunks where the prefill kernel takes the head size, or
both (a served step, where a new prompt joins the running requests), then runs every layer in one
call, with the same kernels in the same order, so the outputs are the layer path's bit for bit.

It takes pre-norm Llama-shaped layers as `LlamaDecoderLayer` builds them (Llama, Mistral, Qwen2
and the GGUF files of those): RMSNorm, NeoX rotary, no sliding window or soft-capping, no q/k
norms, SiLU-gated MLP, no residual scaling; one tensor-parallel rank; and either

- float32 activations and KV cache, every linear layer quantized in a form the CPU kernels
  compute from (GGUF blocks, weight-only int4/int8 without act order, W8A8 int8) or float32 in
  the GEMM's packed form (where that GEMM runs: AVX-512), or
- bfloat16 activations and KV cache, every linear layer in the bf16 GEMM's packed form (a bf16
  model: ``dtype="auto"`` on a bf16 checkpoint or a BF16 GGUF).

The call ends with the model's final norm; given the LM head in a form the layers could take, a
decode step whose rows all sample plainly (greedy, or temperature 1 unfiltered) ends with their
tokens too (`CpuDecoder.sample`). Anything else, and ``FERROLLM_CPU_FUSED_DECODE=0``, keeps the
layer path; the log says which once.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ferrollm import _core
from ferrollm.attention import cpu_backend
from ferrollm.attention.selector import get_attn_backend
from ferrollm.kernels.cpu import _buf, _threads, as_contiguous, gemm_bf16, supports
from ferrollm.model_executor.layers.cpu_gemm import MLP_SLAB_ROWS

__all__ = ["CpuDecoder", "build_cpu_decoder"]

logger = logging.getLogger(__name__)


class CpuDecoder:
    """A model's decoder layers on the Rust side, and the tensors they read kept alive."""

    def __init__(self, core: _core.CpuDecoder, held: list[torch.Tensor], cos_sin: torch.Tensor,
                 dtype: torch.dtype, head_dim: int, head_width: int | None = None):
        self._core = core
        # The LM head's output features where the decoder holds it (`sample`); the logits it
        # writes there are scratch, kept from step to step.
        self._head_width = head_width
        self._logits = torch.empty(0, dtype=dtype)
        # Prompt chunks too, where the Rust prefill kernel takes the head size.
        self._chunks = bool(_core.cpu_paged_prefill_supported(head_dim))
        self.dtype = dtype  # of the activations, norms, rotary table and KV cache
        self._held = held  # every tensor `core` reads by address
        self._cos_sin = cos_sin
        self._caches: tuple[list[torch.Tensor], list[tuple[tuple[int, int], tuple[int, int]]]] | None = None

    def takes(self, hidden_states: torch.Tensor, kv_caches: list[torch.Tensor]) -> bool:
        """Whether a decode step with these activations and caches can run here."""
        if hidden_states.dtype != self.dtype or hidden_states.dim() != 2:
            return False
        # The stack's attention is the torch CPU backend's kernel: where the layers would take
        # another backend (FERROLLM_ATTENTION_BACKEND=TRITON on CPU tensors), they keep it.
        if get_attn_backend(hidden_states.device) is not cpu_backend:
            return False
        return self._cache_buffers(kv_caches) is not None

    def takes_step(self, attn_metadata) -> bool:
        """Whether the step's rows can run here: decode rows, or up to `MLP_SLAB_ROWS` tokens
        with prompt chunks among them (a served step: a new prompt beside the running requests'
        next tokens) where the prefill kernel takes the head size (AVX-512, a multiple of 64). A
        longer step keeps the layer path, whose MLP runs in slabs of that many rows: the stack's
        scratch is as wide as the step (a 4096-token chunk's gate/up alone would be 160 MB on
        Qwen2-0.5B), and the Python between calls is small beside its work."""
        if attn_metadata.is_decode_only:
            return True
        return attn_metadata.num_tokens <= MLP_SLAB_ROWS and self._chunks

    @property
    def holds_lm_head(self) -> bool:
        """Whether `sample` can run: the decoder holds the model's LM head."""
        return self._head_width is not None

    def run(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            attn_metadata) -> torch.Tensor:
        """Every layer and the model's final norm for a step `takes_step` accepted: the normed
        hidden states the LM head reads. ``hidden_states`` (the embeddings) is left as it was."""
        return self._run(hidden_states, positions, kv_caches, attn_metadata, None)

    def sample(self, hidden_states: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
               attn_metadata, uniforms: torch.Tensor | None) -> torch.Tensor:
        """`run`, then the LM head and each row's token (int64 ``[rows]``) in the same call: the
        greedy one, or with ``uniforms`` (float64, one per row) the one drawn at that number from
        the logits as they are, as the sampler's `sample_rows` draws. For a decode step whose
        every row samples so, with nothing that edits its logits (the runner checks): the step
        returns to Python with its tokens. Between the weight streams, Python and torch run from
        caches the weights evicted: the head's product, its slicing and the sampler as separate
        calls took ~0.45 ms of a Qwen2-0.5B Q4_0 step."""
        assert self._head_width is not None, "call only where `holds_lm_head`"
        size = hidden_states.shape[0] * self._head_width
        if self._logits.numel() < size:
            self._logits = torch.empty(size, dtype=self.dtype)
        tokens = torch.empty(hidden_states.shape[0], dtype=torch.int64)
        draw = None if uniforms is None else as_contiguous(uniforms, torch.float64)
        self._run(hidden_states, positions, kv_caches, attn_metadata,
                  (_buf(self._logits[:size]), _buf(tokens), None if draw is None else _buf(draw)))
        return tokens

    def _run(self, hidden_states, positions, kv_caches, attn_metadata, sample) -> torch.Tensor:
        caches = self._cache_buffers(kv_caches)
        assert caches is not None, "call only where `takes` holds"
        hidden = hidden_states.clone(memory_format=torch.contiguous_format)
        residual = torch.empty_like(hidden)
        positions = as_contiguous(positions, torch.int64)
        slots = as_contiguous(attn_metadata.slot_mapping, torch.int64)
        tables = as_contiguous(attn_metadata.block_tables, torch.int32)
        lens = as_contiguous(attn_metadata.seq_lens, torch.int32)
        starts = None if attn_metadata.is_decode_only else as_contiguous(attn_metadata.query_start_loc, torch.int32)
        # Every tensor passed by address stays referenced here until the call returns.
        self._core.run(_buf(hidden), _buf(residual), _buf(positions), _buf(slots), _buf(tables), tables.shape[1],
                       _buf(lens), attn_metadata.block_size, _buf(self._cos_sin), caches, _threads(),
                       None if starts is None else _buf(starts), sample)
        return hidden

    def _cache_buffers(self, kv_caches: list[torch.Tensor]):
        # The engine hands the same cache tensors every step: their addresses are looked up once,
        # and again whenever any tensor in the list is another one.
        if self._caches is not None and len(self._caches[0]) == len(kv_caches) and all(
                a is b for a, b in zip(self._caches[0], kv_caches)):
            return self._caches[1]
        if len(kv_caches) != len(self._core) or not all(
                c.dtype == self.dtype and c.is_cpu and c.is_contiguous() for c in kv_caches):
            return None
        buffers = [(_buf(c[0]), _buf(c[1])) for c in kv_caches]
        self._caches = (list(kv_caches), buffers)
        return buffers


def build_cpu_decoder(model: nn.Module, lm_head: nn.Module | None = None) -> CpuDecoder | None:
    """The one-call decoder for ``model`` (a `LlamaModel`), or None where its layers need the
    layer path (the reason is logged once); with ``lm_head`` (a `ParallelLMHead`) where its form
    is one the decoder multiplies by, for `CpuDecoder.sample`."""
    reason = _refusal(model)
    if reason is not None:
        logger.info("one-call CPU decode off: %s", reason)
        return None
    layers = list(model.layers)
    attn = layers[0].self_attn
    dtype = layers[0].input_layernorm.weight.dtype
    # The final norm too: its call from Python cost more than its work (~0.1 ms of a Qwen2-0.5B
    # step, that code evicted from the caches by the weights streamed just before).
    held: list[torch.Tensor] = [model.norm.weight.detach()]
    specs = [_layer_spec(layer, held) for layer in layers]
    head = _head_spec(lm_head, dtype, held)
    rope = attn.rotary_emb
    core = _core.CpuDecoder(model.norm.weight.shape[0], attn.attn.num_heads, attn.attn.num_kv_heads, attn.head_dim,
                            rope.rotary_dim, layers[0].mlp.down_proj.input_size_per_partition,
                            float(layers[0].input_layernorm.variance_epsilon), float(attn.attn.scale), specs,
                            _DTYPE_NAMES[dtype], final_norm=_buf(held[0]),
                            lm_head=None if head is None else (head, lm_head.org_vocab_size))
    logger.info("one-call CPU decode on: %d layers, %s activations, weights as %s; plain greedy or random "
                "steps %s", len(layers), _DTYPE_NAMES[dtype],
                sorted({_form_name(layer.self_attn.qkv_proj._cpu) for layer in layers}),
                "sample in the call" if head else "sample in Python (the head's form stays there)")
    return CpuDecoder(core, held, rope.cos_sin_cache, dtype, attn.head_dim,
                      None if head is None else lm_head._cpu.out_features)


def _head_spec(lm_head: nn.Module | None, dtype: torch.dtype, held: list[torch.Tensor]) -> tuple | None:
    """The LM head as the decoder multiplies by it, or None: one rank's head without a bias, in a
    form the layers could take with these activations."""
    form = getattr(lm_head, "_cpu", None)
    if lm_head is None or form is None or lm_head.tp_size != 1 or lm_head.bias is not None:
        return None
    if (dtype == torch.bfloat16) != _is_packed_bf16(form):
        return None
    return _linear_spec(lm_head, held)


_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def _form_name(form) -> str:
    return getattr(form, "kind", None) or type(form).__name__


def _refusal(model: nn.Module) -> str | None:
    """Why the layer path must run ``model``'s layers, or None."""
    from ferrollm.model_executor.layers.norm import RMSNorm
    from ferrollm.model_executor.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    if os.environ.get("FERROLLM_CPU_FUSED_DECODE", "1") == "0":
        return "FERROLLM_CPU_FUSED_DECODE=0"
    if not supports(torch.empty(0)):
        return "the Rust CPU kernels are off (FERROLLM_CPU_KERNELS=0, or torch has no OpenMP team to join)"
    layers = list(getattr(model, "layers", []))
    if not layers:
        return "no decoder layers"
    first = layers[0]
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention \
                or type(layer.mlp) is not LlamaMLP:
            return f"{type(layer).__name__} is not a plain Llama decoder layer"
        reason = _layer_refusal(layer)
        if reason is not None:
            return reason
        # The Rust side takes one shape, rotary table, scale and epsilon for the whole stack.
        if (layer.self_attn.rotary_emb is not first.self_attn.rotary_emb
                or layer.self_attn.attn.scale != first.self_attn.attn.scale
                or layer.input_layernorm.variance_epsilon != first.input_layernorm.variance_epsilon
                or layer.post_attention_layernorm.variance_epsilon != first.input_layernorm.variance_epsilon
                or layer.mlp.down_proj.input_size_per_partition != first.mlp.down_proj.input_size_per_partition):
            return "layers that differ in rotary embedding, attention scale, norm epsilon or MLP width"
    norm = getattr(model, "norm", None)
    if type(norm) is not RMSNorm or norm._gemma or norm.variance_epsilon != first.input_layernorm.variance_epsilon \
            or norm.weight.dtype != first.input_layernorm.weight.dtype or not norm.weight.is_contiguous():
        return "a final norm other than the layers' RMSNorm"
    return None


def _layer_refusal(layer: nn.Module) -> str | None:
    from ferrollm.model_executor.layers.activation import SiluAndMul
    from ferrollm.model_executor.layers.norm import RMSNorm
    from ferrollm.model_executor.layers.rotary import RotaryEmbedding

    attn, mlp = layer.self_attn, layer.mlp
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    dtype = layer.input_layernorm.weight.dtype
    if layer.residual_multiplier != 1.0 or attn.qk_norm or attn.attn.sliding_window is not None \
            or attn.attn.logits_soft_cap is not None:
        return "residual scaling, q/k norms, a sliding window or soft-capping"
    if dtype not in _DTYPE_NAMES or any(
            type(n) is not RMSNorm or n._gemma or n.weight.dtype != dtype or not n.weight.is_cpu for n in norms):
        return "norms other than RMSNorm in float32 or bfloat16"
    if not isinstance(mlp.act_fn, SiluAndMul):
        return "an MLP activation other than SiLU"
    rope = attn.rotary_emb
    # Exactly RotaryEmbedding: M-RoPE (Qwen2-VL) subclasses it with positions of another shape.
    if type(rope) is not RotaryEmbedding or not rope.is_neox_style or rope.cos_sin_cache.dtype != dtype \
            or not rope.cos_sin_cache.is_cpu:
        return "a rotary embedding other than plain NeoX style in the norms' dtype"
    for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if proj.tp_size != 1:
            return "tensor parallelism"
        if _linear_spec(proj, []) is None or (dtype == torch.bfloat16) != _is_packed_bf16(proj._cpu):
            return (f"a {type(proj._cpu).__name__} weight ({proj.extra_repr()}) the one-call path does not take "
                    f"with {_DTYPE_NAMES.get(dtype, dtype)} activations")
        if proj.bias is not None and (proj is not attn.qkv_proj or proj.bias.dtype != dtype):
            return "biases other than q/k/v biases in the norms' dtype"
    return None


def _layer_spec(layer: nn.Module, held: list[torch.Tensor]) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    norms = [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
    bias = None if attn.qkv_proj.bias is None else attn.qkv_proj.bias.detach().contiguous()
    held += norms + ([] if bias is None else [bias])
    return (_buf(norms[0]), _buf(norms[1]), _linear_spec(attn.qkv_proj, held), None if bias is None else _buf(bias),
            _linear_spec(attn.o_proj, held), _linear_spec(mlp.gate_up_proj, held), _linear_spec(mlp.down_proj, held))


def _linear_spec(proj: nn.Module, held: list[torch.Tensor]) -> tuple | None:
    """The Rust description of ``proj``'s weight (see ``rust/bindings/src/decoder.rs``), or None
    for a form the one-call path does not take; its tensors are added to ``held``."""
    from ferrollm.kernels.cpu.gguf import segment_buffer
    from ferrollm.model_executor.layers.cpu_weights import PackedWeight
    from ferrollm.model_executor.layers.quantization import qweights as qw
    from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear

    form = proj._cpu
    if _is_packed_bf16(form):
        held.append(form.weight)
        return ("bf16", _buf(form.weight), form.out_features, form.in_features, gemm_bf16.kernel())
    if isinstance(form, PackedWeight):
        held.append(form.weight)
        return ("f32", _buf(form.weight), form.out_features, form.in_features, form.gated)
    if not isinstance(form, QuantizedLinear) or not form.on_cpu:
        return None
    if form.kind == "gguf":
        held += form.segment_tensors()
        return ("gguf", form.in_features, [segment_buffer(s, form.in_features) for s in form.segments],
                form.residual_activations)
    w = form.source
    if isinstance(w, qw.IntWeight) and w.perm is None:
        held += [form.packed, w.scales] + ([] if w.mins is None else [w.mins])
        return ("wq", w.bits, _buf(form.packed), _buf(w.scales), None if w.mins is None else _buf(w.mins),
                form.out_features, form.in_features, w.group_size)
    if isinstance(w, qw.Int8ActWeight) and w.scale.dtype == torch.float32 and w.scale.is_contiguous():
        held += [form.packed, w.scale]
        scale = None if w.input_scale is None else float(w.input_scale)
        return ("w8a8", _buf(form.packed), _buf(w.scale), scale, int(w.input_zero_point), form.out_features,
                form.in_features)
    return None


def _is_packed_bf16(form) -> bool:
    from ferrollm.model_executor.layers.cpu_weights import PackedBf16Weight

    return isinstance(form, PackedBf16Weight)
