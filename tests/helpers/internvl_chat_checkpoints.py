"""OpenGVLab's InternVL layout (``InternVLChatModel``) from transformers' InternVL: transformers has
no copy of the remote code, so the tiny random -hf InternVL of `internvl_checkpoints` is written
under the published names (``vision_model.*`` with a fused ``attn.qkv``, ``mlp1.{0,1,3}``,
``language_model.*``: the Llama text re-laid as InternLM2, or a Qwen2 as it is) with an
``internvl_chat`` config.json, and the -hf model stays the reference. Its processor tiles as the
chat model's ``dynamic_preprocess`` does (ImageNet mean and std); that function is written out
here as the published reference of the tiling."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import transformers
from helpers.internlm2_checkpoints import internlm2_config_dict, llama_state_as_internlm2
from helpers.internvl_checkpoints import TILE, _processor_without_video, build_internvl_checkpoint

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
MAX_DYNAMIC_PATCH = 6

# transformers' vision names -> InternViT's (after q/k/v are fused).
_VISION = (
    ("embeddings.cls_token", "embeddings.class_embedding"),
    ("embeddings.patch_embeddings.projection.", "embeddings.patch_embedding."),
    ("embeddings.position_embeddings", "embeddings.position_embedding"),
    ("encoder.layer.", "encoder.layers."),
    (".attention.projection_layer.", ".attn.proj."),
    (".attention.q_norm.", ".attn.q_norm."),
    (".attention.k_norm.", ".attn.k_norm."),
    (".layernorm_before.", ".norm1."),
    (".layernorm_after.", ".norm2."),
    (".lambda_1", ".ls1"),
    (".lambda_2", ".ls2"),
)
_PROJECTOR = {"layer_norm.": "mlp1.0.", "linear_1.": "mlp1.1.", "linear_2.": "mlp1.3."}


def _vision_tensors(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf.items():
        if ".attention.k_proj." in name or ".attention.v_proj." in name:
            continue
        if ".attention.q_proj." in name:
            parts = [hf[name.replace(".q_proj.", f".{p}_proj.")] for p in "qkv"]
            name, tensor = name.replace(".attention.q_proj.", ".attn.qkv."), torch.cat(parts)
        for old, new in _VISION:
            name = name.replace(old, new)
        out["vision_model." + name] = tensor
    return out


def chat_state(hf: dict[str, torch.Tensor], text_config, internlm2: bool) -> dict[str, torch.Tensor]:
    """The -hf checkpoint's tensors (hub names) under ``InternVLChatModel``'s names."""
    vision = {k.removeprefix("vision_tower."): v for k, v in hf.items() if k.startswith("vision_tower.")}
    out = _vision_tensors(vision)
    for name, tensor in hf.items():
        if name.startswith("multi_modal_projector."):
            local = name.removeprefix("multi_modal_projector.")
            prefix = next(p for p in _PROJECTOR if local.startswith(p))
            out[_PROJECTOR[prefix] + local.removeprefix(prefix)] = tensor
    text = {k: v for k, v in hf.items() if k.startswith("language_model.")}
    assert len(vision) + len(text) + sum(k.startswith("multi_modal") for k in hf) == len(hf), "unmapped tensors"
    if internlm2:
        text = llama_state_as_internlm2(text, text_config.num_attention_heads, text_config.num_key_value_heads,
                                        prefix="language_model.")
    return {**out, **text}


def chat_config(hf_config, internlm2: bool) -> dict:
    vision = hf_config.vision_config
    if internlm2:
        llm = internlm2_config_dict(hf_config.text_config, bias=False)
    else:
        llm = {**hf_config.text_config.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    return {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                     "AutoModel": "modeling_internvl_chat.InternVLChatModel"},
        "llm_config": llm,
        "vision_config": {
            "model_type": "intern_vit_6b", "architectures": ["InternVisionModel"], "hidden_size": vision.hidden_size,
            "intermediate_size": vision.intermediate_size, "num_hidden_layers": vision.num_hidden_layers,
            "num_attention_heads": vision.num_attention_heads, "image_size": TILE, "patch_size": 14,
            "qkv_bias": vision.attention_bias, "qk_normalization": vision.use_qk_norm, "norm_type": vision.norm_type,
            "layer_norm_eps": vision.layer_norm_eps, "hidden_act": vision.hidden_act, "use_flash_attn": False,
            "drop_path_rate": 0.0, "initializer_factor": 1.0},
        "downsample_ratio": hf_config.downsample_ratio, "force_image_size": TILE, "dynamic_image_size": True,
        "min_dynamic_patch": 1, "max_dynamic_patch": MAX_DYNAMIC_PATCH, "use_thumbnail": True, "ps_version": "v2",
        "select_layer": -1, "template": "internlm2-chat", "torch_dtype": "float32", "use_backbone_lora": 0,
        "use_llm_lora": 0, "pad2square": False,
    }


def build_internvl_chat_checkpoint(folder: Path, tokenizer_dir: Path, internlm2: bool = True):
    """Writes a tiny ``InternVLChatModel`` to ``folder`` (InternLM2 text, or Qwen2 when not
    ``internlm2``); returns the transformers -hf model it was made from and an
    ``InternVLProcessor`` that tiles as ``dynamic_preprocess`` does."""
    from safetensors.torch import load_file, save_file
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    hf_dir = folder.parent / f"{folder.name}-hf"
    model, _ = build_internvl_checkpoint(hf_dir, tokenizer_dir, text_type="llama" if internlm2 else "qwen2")
    folder.mkdir(parents=True, exist_ok=True)
    state = chat_state(load_file(hf_dir / "model.safetensors"), model.config.text_config, internlm2)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(chat_config(model.config, internlm2), indent=1))
    shutil.copy(hf_dir / "tokenizer.json", folder / "tokenizer.json")
    # As on the hub: <img>, </img> and <IMG_CONTEXT> are added tokens, named nowhere else.
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    image_processor = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=MAX_DYNAMIC_PATCH,
                                               image_mean=list(IMAGENET_MEAN), image_std=list(IMAGENET_STD))
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    return model, _processor_without_video(image_processor, hf_tok)


def dynamic_preprocess(image, min_num: int, max_num: int, image_size: int, use_thumbnail: bool) -> torch.Tensor:
    """InternVL2's published tiling (its model card's ``dynamic_preprocess`` and
    ``build_transform``), the reference the engine's tiles are compared with: ``[tiles, 3, S, S]``."""
    import torchvision.transforms as T
    from torchvision.transforms.functional import InterpolationMode

    width, height = image.size
    aspect = width / height
    ratios = sorted({(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1) for j in range(1, n + 1)
                     if min_num <= i * j <= max_num}, key=lambda r: r[0] * r[1])
    best, best_diff = (1, 1), float("inf")
    for ratio in ratios:
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best, best_diff = ratio, diff
        elif diff == best_diff and width * height > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
            best = ratio
    resized = image.resize((image_size * best[0], image_size * best[1]))
    tiles = [resized.crop(((i % best[0]) * image_size, (i // best[0]) * image_size,
                           (i % best[0] + 1) * image_size, (i // best[0] + 1) * image_size))
             for i in range(best[0] * best[1])]
    if use_thumbnail and len(tiles) != 1:
        tiles.append(image.resize((image_size, image_size)))
    transform = T.Compose([T.Lambda(lambda img: img.convert("RGB")),
                           T.Resize((image_size, image_size), interpolation=InterpolationMode.BICUBIC),
                           T.ToTensor(), T.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)])
    return torch.stack([transform(tile) for tile in tiles])
