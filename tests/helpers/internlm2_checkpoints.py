"""InternLM2's published layout from a transformers Llama: transformers has no InternLM2, so a tiny
Llama's weights are written under InternLM2's names (``tok_embeddings``, ``attention.wqkv`` grouped
per KV head, ``attention.wo``, ``feed_forward.w1/w3/w2``, ``attention_norm``, ``ffn_norm``,
``output``) with an ``internlm2`` config.json, and the Llama stays the reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_RENAMES = (
    ("model.embed_tokens.", "model.tok_embeddings."),
    (".self_attn.o_proj.", ".attention.wo."),
    (".mlp.gate_proj.", ".feed_forward.w1."),
    (".mlp.up_proj.", ".feed_forward.w3."),
    (".mlp.down_proj.", ".feed_forward.w2."),
    (".input_layernorm.", ".attention_norm."),
    (".post_attention_layernorm.", ".ffn_norm."),
)


def fuse_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """q, k, v weights (or biases) as InternLM2's ``wqkv``: for each KV head, its ``num_heads /
    num_kv_heads`` query heads, then its key head, then its value head."""
    d = q.shape[0] // num_heads
    group = num_heads // num_kv_heads
    rest = q.shape[1:]
    qg = q.reshape(num_kv_heads, group, d, *rest)
    kg, vg = k.reshape(num_kv_heads, 1, d, *rest), v.reshape(num_kv_heads, 1, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def llama_state_as_internlm2(state: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int,
                             prefix: str = "") -> dict[str, torch.Tensor]:
    """A Llama/Qwen2 state dict (names below ``prefix``) under InternLM2's names."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        local = name.removeprefix(prefix)
        if ".self_attn.k_proj." in local or ".self_attn.v_proj." in local:
            continue
        if ".self_attn.q_proj." in local:
            kind = local.rsplit(".", 1)[1]
            base = prefix + local.split(".self_attn.")[0] + ".self_attn."
            q, k, v = (state[f"{base}{p}_proj.{kind}"] for p in "qkv")
            local = local.replace(".self_attn.q_proj.", ".attention.wqkv.")
            out[prefix + local] = fuse_wqkv(q, k, v, num_heads, num_kv_heads)
            continue
        if local.startswith("lm_head."):
            local = "output." + local.removeprefix("lm_head.")
        for old, new in _RENAMES:
            local = local.replace(old, new)
        out[prefix + local] = tensor.contiguous()
    return out


def internlm2_config_dict(text_config, bias: bool) -> dict:
    """The remote code's config.json fields for a transformers Llama/Qwen2 text config."""
    rope = dict(getattr(text_config, "rope_parameters", None) or {})
    return {
        "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
        "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                     "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"},
        "vocab_size": text_config.vocab_size, "hidden_size": text_config.hidden_size,
        "intermediate_size": text_config.intermediate_size, "num_hidden_layers": text_config.num_hidden_layers,
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": text_config.num_key_value_heads, "hidden_act": "silu",
        "max_position_embeddings": text_config.max_position_embeddings, "rms_norm_eps": text_config.rms_norm_eps,
        "bias": bias, "rope_theta": rope.get("rope_theta", 10000.0),
        # InternVL2's InternLM2 ships dynamic NTK scaling; it changes nothing within max_position_embeddings.
        "rope_scaling": {"type": "dynamic", "factor": 2.0}, "attn_implementation": "eager",
        "tie_word_embeddings": bool(text_config.tie_word_embeddings), "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "torch_dtype": "float32",
    }


def write_as_internlm2(llama, folder: Path) -> Path:
    """Writes a transformers Llama (``attention_bias`` gives InternLM2's ``bias``) as an InternLM2
    checkpoint in ``folder`` (tokenizer files are the caller's)."""
    from safetensors.torch import save_file

    config = llama.config
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach() for k, v in llama.state_dict().items()}
    tensors = llama_state_as_internlm2(state, config.num_attention_heads, config.num_key_value_heads)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    values = internlm2_config_dict(config, bool(config.attention_bias))
    (folder / "config.json").write_text(json.dumps(values, indent=1))
    return folder
