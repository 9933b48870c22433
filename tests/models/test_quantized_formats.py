"""GPTQ, AWQ and fp8 checkpoints (packed in the test from their documented layouts,
`helpers.quant_checkpoints`), and ``quantization=`` on a float checkpoint, against transformers
running the dequantized weights.

Where activations are quantized too (fp8, int8), the reference quantizes each linear layer's input
the way vLLM does (`_quantize_inputs`). Tolerances: 1e-4 where only weights are quantized (float32
summation order); where activations are rounded to 8 bits, an input within float32 rounding of a
rounding tie falls either side of it in the two engines: a crossed e4m3 step (1/8 of the value's
power of two) moved a logit by up to 0.15 here (0.2 allowed), a crossed int8 step (1/127 of the
token's largest value) by up to 0.083 (0.15 allowed); the greedy tokens must agree all the same.
Symmetric int4/int8 with fp16 scales runs, on CPUs with AVX512-VNNI, as Q4_0/Q8_0 blocks meeting
the activations as two 8-bit parts (`quantization.int_blocks`, within `max|x_b| / 254²` of each
element of a 32-element block): BLOCKS_LOGITS_TOL (GPTQ, up to 1.1e-3 measured).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.engine_driver import TINY, hf_greedy, make_prompts, run_engine
from helpers.quant_checkpoints import reference_model, write_awq, write_fp8, write_gptq

from ferrollm.exceptions import CheckpointError, ConfigError
from ferrollm.kernels.cpu.gguf import interleave_preferred
from ferrollm.model_executor.layers.quantization import int_blocks, resolve_quantization
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.dynamic_int import quantize_int8_rows, quantize_rtn
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear
from ferrollm.model_executor.layers.quantization.fp8 import quantize_fp8
from ferrollm.model_executor.loader import get_model, iterate_safetensors

_BIG = dict(TINY, hidden_size=256, intermediate_size=512)
BLOCKS_LOGITS_TOL = 3e-3
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def _float_model(shape=TINY, seed=0):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()


def _load(folder, quantization=None):
    config = transformers.AutoConfig.from_pretrained(folder)
    quant = resolve_quantization(config, quantization, False)
    return get_model(config, torch.float32, iterate_safetensors(folder), quant_config=quant)


def _check(model, reference, atol, num_prompts=3, per_step=False):
    prompts = make_prompts(num_prompts, seed=2, vocab=reference.config.vocab_size)
    run = run_engine(model, prompts, 6)
    for i, prompt in enumerate(prompts):
        tokens, logits = (_generate_logits if per_step else hf_greedy)(reference, prompt, 6)
        assert run.tokens[str(i)] == tokens, f"request {i}"
        torch.testing.assert_close(torch.stack(run.logits[str(i)]), logits, atol=atol, rtol=0)


@torch.no_grad()
def _generate_logits(model, prompt, max_tokens):
    """transformers' greedy tokens and the logits of its own decode steps: where a scale spans
    the rows of a step (dynamic per-tensor), a forward pass over the whole sequence would scale
    the rows differently from the steps that chose the tokens."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


def _quantize_inputs(model, how: str, static_scale: float | None = None, group: int = 128) -> None:
    """Rounds every decoder linear layer's input as vLLM's kernels do before the product."""
    def fp8(x, scale):
        return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale

    def hook(_module, inputs):
        x = inputs[0]
        if how == "int8_token":
            s = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
            return (torch.round(x / s).clamp(-128, 127) * s,)
        if how == "fp8_tensor":
            return (fp8(x, (x.abs().max() / FP8_MAX).clamp(min=1e-12)),)
        if how == "fp8_static":
            return (fp8(x, static_scale),)
        g = x.unflatten(-1, (-1, group))  # fp8 per token and group
        return (fp8(g, (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)).flatten(-2),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and "layers." in name:
            module.register_forward_pre_hook(hook)


# Groups of 96 end short of the MLP's 128 inputs (and span the whole of the attention's 64), as
# GPTQ tools write groups of 128 over SmolLM2's 576: the layers run them as groups of 32.
@pytest.mark.parametrize("bits,group,desc_act", [(4, 32, False), (4, 32, True), (8, 32, False), (4, -1, False),
                                                 (8, 64, True), (4, 96, False), (4, 96, True)])
def test_gptq(tmp_path, bits, group, desc_act):
    model = _float_model()
    weights = write_gptq(model, tmp_path, bits=bits, group_size=group, desc_act=desc_act)
    ours = _load(tmp_path)
    # Symmetric rows in order, with GPTQ's fp16 scales, run as GGUF blocks where the CPU runs
    # those (activations as two 8-bit parts: see the module doc).
    kinds = {m._cpu.kind for m in ours.modules() if isinstance(getattr(m, "_cpu", None), QuantizedLinear)}
    if not desc_act:
        runs_blocks = interleave_preferred(int_blocks.GGML_Q4_0 if bits == 4 else int_blocks.GGML_Q8_0)
        assert kinds == {"gguf" if runs_blocks else "IntWeight"}
    _check(ours, reference_model(model, weights), atol=BLOCKS_LOGITS_TOL if "gguf" in kinds else 1e-4)


def test_gptq_marlin_name_runs_as_gptq_and_other_names_are_refused(tmp_path):
    model = _float_model()
    write_gptq(model, tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert resolve_quantization(config, "gptq_marlin", False).name == "gptq"
    with pytest.raises(ConfigError, match=r"`quantization='awq'` contradicts the checkpoint.*'gptq'"):
        resolve_quantization(config, "awq", False)


@pytest.mark.parametrize("group", [32, 96])
def test_awq(tmp_path, group):
    model = _float_model()
    weights = write_awq(model, tmp_path, group_size=group)
    _check(_load(tmp_path), reference_model(model, weights), atol=1e-4)


def test_awq_zero_point_false_with_qzeros_reads_them(tmp_path):
    # gptqmodel writes `zero_point: false` beside qzeros (all 8 for its symmetric AWQ): vLLM's
    # kernels read them, and so does the loader.
    model = _float_model()
    weights = write_awq(model, tmp_path, group_size=32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["zero_point"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    _check(_load(tmp_path), reference_model(model, weights), atol=1e-4)


def test_groups_ending_short_run_as_their_common_size_or_are_refused_at_load():
    q = torch.randint(0, 16, (8, 576), dtype=torch.uint8)
    scales, mins = torch.rand(8, 5), torch.rand(8, 5)
    weight = qw.IntWeight(q, scales, mins, 4, 128)
    regrouped = weight.in_whole_groups()
    assert regrouped.group_size == 64 and regrouped.scales.shape == (8, 9)
    torch.testing.assert_close(regrouped.dequantize(), weight.dequantize(), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match=r"group_size \(48\) neither divides its in_features \(72\).*is 24"):
        qw.IntWeight(q[:, :72], scales[:, :2], None, 4, 48).in_whole_groups()


@pytest.mark.parametrize("kind", ["dynamic", "static", "block"])
def test_fp8_checkpoint(tmp_path, kind):
    model = _float_model(_BIG if kind == "block" else TINY)
    weights = write_fp8(model, tmp_path, block=(128, 128) if kind == "block" else None, static=kind == "static")
    reference = reference_model(model, weights)
    _quantize_inputs(reference, {"dynamic": "fp8_tensor", "static": "fp8_static", "block": "fp8_group"}[kind], 0.05)
    # A dynamic per-tensor scale spans every row of a step, as in vLLM: one request at a time,
    # so the engine's steps hold the rows transformers' forward passes do.
    _check(_load(tmp_path), reference, atol=0.2, num_prompts=1 if kind == "dynamic" else 3, per_step=kind == "dynamic")


def _dequantized(model, quantize) -> dict[str, torch.Tensor]:
    return {name: quantize(p.detach()).dequantize() for name, p in model.state_dict().items()
            if name.endswith("_proj.weight")}


@pytest.mark.parametrize("method", ["fp8", "int8", "rtn"])
def test_quantization_argument_quantizes_a_float_checkpoint(tmp_path, method):
    model = _float_model()
    model.save_pretrained(tmp_path)
    quantize = {"fp8": quantize_fp8, "int8": quantize_int8_rows, "rtn": lambda w: quantize_rtn(w, 8, 32)}[method]
    reference = reference_model(model, _dequantized(model, quantize))
    if method == "fp8":
        _quantize_inputs(reference, "fp8_tensor")
    elif method == "int8":
        _quantize_inputs(reference, "int8_token")
    if method == "rtn":
        import os
        os.environ["RTN_GROUP_SIZE"] = "32"
    try:
        ours = _load(tmp_path, method)
    finally:
        os.environ.pop("RTN_GROUP_SIZE", None) if method == "rtn" else None
    # fp8's per-tensor scale covers q, k and v apart here, as one tensor each: the reference too.
    _check(ours, reference, atol={"rtn": 1e-4, "fp8": 0.2, "int8": 0.15}[method],
           num_prompts=1 if method == "fp8" else 3, per_step=method == "fp8")


def test_unknown_and_impossible_methods_are_refused(tmp_path):
    model = _float_model()
    model.save_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"`quantization` must be one of .*'fp8'.*Given: 'int3'"):
        resolve_quantization(config, "int3", False)
    with pytest.raises(ConfigError, match=r"needs a checkpoint quantized with it.*\['fp8', 'int8', 'rtn'\]"):
        resolve_quantization(config, "gptq", False)
    config.quantization_config = {"quant_method": "bitsandbytes"}
    with pytest.raises(ConfigError, match=r"'bitsandbytes' is not supported; supported: \[.*'awq'"):
        resolve_quantization(config, None, False)
    config.quantization_config = {"quant_method": "gptq", "bits": 3}
    with pytest.raises(ConfigError, match=r"GPTQ `bits` must be 4 or 8. Given: 3"):
        resolve_quantization(config, None, False)


def test_group_size_that_cuts_a_tensor_parallel_shard_is_an_error():
    from ferrollm.model_executor.layers.quantization.qweights import IntWeight

    w = IntWeight(torch.zeros(4, 96, dtype=torch.uint8), torch.ones(4, 3), None, 4, 32)
    assert w.narrow(1, 32, 64).shape == (4, 64)
    with pytest.raises(CheckpointError, match=r"cuts its groups of 32.*48"):
        w.narrow(1, 48, 48)


def test_moe_experts_stay_float_under_dynamic_quantization_and_static_ones_are_refused(tmp_path):
    from helpers.engine_driver import build_checkpoint

    build_checkpoint("mixtral", tmp_path)
    model = _load(tmp_path, "int8")  # attention quantized, experts float
    assert model is not None
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    from ferrollm.model_executor.layers.quantization import attach_quant_methods
    from ferrollm.model_executor.loader import build_model

    with pytest.raises(ConfigError, match=r"quantized MoE experts are not supported"):
        attach_quant_methods(build_model(config, torch.float32), resolve_quantization(config, None, False), "cpu")
