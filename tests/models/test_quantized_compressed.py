"""compressed-tensors checkpoints, written by compressed-tensors itself from a tiny random Llama,
loaded as they are (no `quantization=`) and run against transformers' forward pass with
compressed-tensors quantizing each layer's weights and inputs on the fly (`write_compressed_tensors`).

W8A8's activations are quantized as vLLM quantizes them (``scaled_int8_quant``: a token's scale
is its largest magnitude over 127), where compressed-tensors' own forward divides by 127.5; the
reference then quantizes its inputs vLLM's way (`_vllm_int8_inputs`).

Tolerances: weight-only schemes compute ``q * scale + min`` where the reference computes
``(q - zero) * scale``, and the products sum in another order: float32 rounding, 1e-4 on logits
of magnitude ~1. Schemes that quantize activations round each activation to 8 bits in both
engines, from inputs that differ by that float32 rounding; an activation that close to a rounding
tie rounds the other way in one of them. An int8 step (1/127 of a token's largest value) did not
happen to be crossed here (1e-4 holds); an e4m3 step is 1/8 of a value's power of two, and a
crossed one moved a logit by up to 0.15 (FP8_BLOCK, measured), so 0.2 there. Each layer on its own, fed the
reference layer's input, agrees to float32 rounding (`test_each_layer_...`).

W4A16 and W8A16 with fp16 scales run, on CPUs with AVX512-VNNI, as Q4_0 and Q8_0 blocks that
meet the activations as two 8-bit parts (`quantization.int_blocks`): each activation within
`max|x_b| / 254²` of its 32-element block's largest magnitude `max|x_b|`. A layer's outputs moved by up to 2.4e-5 of its
largest output here (5e-5 allowed), the logits (of magnitude ~5) by up to 9.4e-4
(3e-3 allowed); the greedy tokens agree.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.engine_driver import TINY, hf_greedy, make_prompts, run_engine
from helpers.quant_checkpoints import write_compressed_tensors

from ferrollm.kernels.cpu.gguf import interleave_preferred
from ferrollm.model_executor.layers.quantization import int_blocks, resolve_quantization
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear
from ferrollm.model_executor.loader import get_model, iterate_safetensors

# W4A16 as Q4_0 blocks: on the logits, and on each layer's outputs relative to its largest output
# (see the module doc).
BLOCKS_LOGITS_TOL = 3e-3
BLOCKS_LAYER_TOL = 5e-5

# scheme -> (group size override, model shape, logits tolerance); "+fp16": the weight scales are
# fp16 values (`write_compressed_tensors`' ``fp16_scales``)
_BIG = dict(TINY, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
CASES = {
    "W4A16": (32, TINY, 1e-4),
    "W4A16+fp16": (32, TINY, BLOCKS_LOGITS_TOL),
    "W4A16_ASYM": (32, TINY, 1e-4),
    "W8A16": (32, TINY, 1e-4),
    "W8A16+fp16": (32, TINY, BLOCKS_LOGITS_TOL),
    "W8A8": (None, TINY, 1e-4),
    "FP8": (None, TINY, 0.2),
    "FP8_DYNAMIC": (None, TINY, 0.2),
    "FP8_BLOCK": (None, _BIG, 0.2),  # 128 x 128 weight blocks
}


@pytest.fixture(scope="module", params=sorted(CASES))
def compressed(request, tmp_path_factory):
    scheme, _, variant = request.param.partition("+")
    group, shape, tol = CASES[request.param]
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    folder = tmp_path_factory.mktemp(f"ct-{scheme}")
    reference = write_compressed_tensors(model, scheme, folder, group_size=group, fp16_scales=variant == "fp16")
    if scheme == "W8A8":
        _vllm_int8_inputs(reference)
    return request.param, folder, _no_eos(reference), tol


def _vllm_int8_inputs(model) -> None:
    """Quantizes each W8A8 layer's input per token with scale ``max |x| / 127`` (vLLM's), instead
    of compressed-tensors' ``/ 127.5``; the weights stay quantized by compressed-tensors."""
    def quantize(_module, inputs):
        x = inputs[0]
        scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
        return (torch.round(x / scale).clamp(-128, 127) * scale,)

    modules = [m for m in model.modules()
               if getattr(getattr(m, "quantization_scheme", None), "input_activations", None) is not None]
    for module in modules:  # the layers may share one scheme object
        module.quantization_scheme.input_activations = None
        module.register_forward_pre_hook(quantize)


def _no_eos(model):
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def test_greedy_tokens_and_logits_match_transformers(compressed):
    scheme, folder, ref, tol = compressed
    config = transformers.AutoConfig.from_pretrained(folder)
    model = get_model(config, torch.float32, iterate_safetensors(folder), quant_config=resolve_quantization(config, None, False))
    layers = [m for m in model.modules() if isinstance(getattr(m, "_cpu", None), QuantizedLinear)]
    assert len(layers) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down; lm_head ignored
    if scheme.endswith("+fp16"):  # Q4_0/Q8_0 blocks where this CPU runs them, else weight-only
        blocks = interleave_preferred(int_blocks.GGML_Q4_0 if scheme.startswith("W4") else int_blocks.GGML_Q8_0)
        assert {layer._cpu.kind for layer in layers} == {"gguf" if blocks else "IntWeight"}
    prompts = make_prompts(3, seed=2, vocab=config.vocab_size)
    run = run_engine(model, prompts, 6)
    for i, prompt in enumerate(prompts):
        tokens, logits = hf_greedy(ref, prompt, 6)
        assert run.tokens[str(i)] == tokens, f"{scheme}: request {i}"
        torch.testing.assert_close(torch.stack(run.logits[str(i)]), logits, atol=tol, rtol=0)


def test_transformers_reads_the_same_weight_only_folder(compressed):
    """The files are the standard ones: transformers reading the folder back gives the same
    logits as the reference, for the schemes it reads correctly."""
    scheme, folder, ref, _ = compressed
    if scheme.partition("+")[0] not in ("W4A16", "W8A16", "FP8_DYNAMIC"):
        pytest.skip("transformers does not read this scheme back faithfully (see write_compressed_tensors)")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([make_prompts(1, seed=3, vocab=ref.config.vocab_size)[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, ref(ids).logits, atol=1e-4, rtol=0)


_PROJECTIONS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
                "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


def test_each_layer_matches_the_reference_layer_on_the_same_input(compressed):
    scheme, folder, ref, _ = compressed
    config = transformers.AutoConfig.from_pretrained(folder)
    model = get_model(config, torch.float32, iterate_safetensors(folder), quant_config=resolve_quantization(config, None, False))
    torch.manual_seed(5)
    for i, layer in enumerate(model.model.layers):
        for fused, (block, parts) in _PROJECTIONS.items():
            ours = getattr(getattr(layer, block), fused)
            theirs = [getattr(getattr(ref.model.layers[i], block), p) for p in parts]
            x = torch.randn(1, 7, theirs[0].in_features)  # 3-D: compressed-tensors quantizes per token only then
            with torch.no_grad():
                expected = torch.cat([m(x)[0] for m in theirs], dim=1)
                blocks = scheme.endswith("+fp16")
                atol, rtol = (BLOCKS_LAYER_TOL * expected.abs().max().item(), 0) if blocks else (1e-5, 1e-5)
                torch.testing.assert_close(ours(x[0]), expected, atol=atol, rtol=rtol, msg=f"{scheme} layer {i} {fused}")
