"""Quantized models through `LLM`: tensor parallelism shards the quantized weights (their scales
and zero points with them), `quantization=` is checked against the checkpoint, and the start-up
log says what the weights shrank to."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from helpers.checkpoints import add_tokenizer
from helpers.engine_driver import TINY
from helpers.quant_checkpoints import write_compressed_tensors, write_gptq
from helpers.tp_cases import assert_same, run

from ferrollm import LLM
from ferrollm.exceptions import CheckpointError, ConfigError
from ferrollm.kernels.cpu.gguf import interleave_preferred
from ferrollm.model_executor.layers.quantization import int_blocks

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


def _tiny(folder, tokenizer_dir, write, **kwargs):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    write(model, folder, **kwargs)
    add_tokenizer(folder, tokenizer_dir)
    return folder


@pytest.mark.parametrize("scheme", ["W4A16", "W4A16+fp16", "W8A8", pytest.param("FP8", marks=pytest.mark.slow)])
def test_two_ranks_generate_what_one_does_on_compressed_tensors(tmp_path, tokenizer_dir, scheme):
    scheme, _, variant = scheme.partition("+")
    group = 32 if scheme == "W4A16" else None
    folder = _tiny(tmp_path, tokenizer_dir, lambda m, f: write_compressed_tensors(
        m, scheme, f, group_size=group, fp16_scales=variant == "fp16"))
    with LLM(str(folder), **ENGINE) as llm:
        single = run(llm)
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as llm:
        sharded = run(llm)
    if variant == "fp16" and interleave_preferred(int_blocks.GGML_Q4_0):
        # Q4_0 blocks meeting the activations as two 8-bit parts (`int_blocks`): the ranks'
        # partial sums add up in another order, which can move an activation across a rounding
        # step of its low part: the greedy tokens agree, the log-probabilities within 1e-3
        # (1.6e-4 measured), and the top two of a near-tie may swap.
        assert sharded[0][:4] == single[0][:4]
        for ours, theirs in zip(sharded[1][1:], single[1][1:], strict=True):
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-3 for t in ours.keys() & theirs.keys())
        return
    if scheme != "W8A8":  # weight-only, or fp8 inputs with a static scale: the same rounding
        return assert_same(sharded, single)
    # A row-parallel layer's rank quantizes its own slice of each token (as in vLLM), so the
    # activation scales, and the rounding, differ from one rank's: the greedy tokens agree, the
    # log-probabilities to a few rounding steps (0.09 measured), and the sampled request may go
    # its own way. (Per-token fp8, FP8_DYNAMIC, rounds to 3 mantissa bits and did not keep the
    # greedy tokens of this near-uniform tiny model: not compared.)
    assert sharded[0][:4] == single[0][:4]
    for ours, theirs in zip(sharded[1][1:], single[1][1:], strict=True):
        assert all(abs(ours[t].logprob - theirs[t].logprob) < 0.15 for t in ours.keys() & theirs.keys())


@pytest.mark.slow  # the same IntWeight sharding as W4A16 above
def test_two_ranks_generate_what_one_does_on_gptq(tmp_path, tokenizer_dir):
    folder = _tiny(tmp_path, tokenizer_dir, write_gptq, bits=4, group_size=32)
    with LLM(str(folder), **ENGINE) as llm:
        single = run(llm)
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as llm:
        assert_same(run(llm), single)


def test_a_group_that_a_rank_would_cut_is_an_error(tmp_path, tokenizer_dir):
    # o_proj has 64 input features: two ranks get 32 each, half of a 64-column group.
    folder = _tiny(tmp_path, tokenizer_dir, write_gptq, bits=4, group_size=64)
    with pytest.raises(CheckpointError, match=r"cuts its groups of 64"):
        LLM(str(folder), tensor_parallel_size=2, **ENGINE)


def test_quantization_argument_and_start_up_log(tmp_path, tokenizer_dir, caplog):
    folder = _tiny(tmp_path, tokenizer_dir, lambda m, f: m.save_pretrained(f))
    with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(str(folder), quantization="int8", **ENGINE) as llm:
        tokens, _ = run(llm)
    assert all(len(t) > 0 for t in tokens)
    assert "quantization: int8 (dynamic W8A8" in caplog.text
    assert "quantized linear weights:" in caplog.text and "from float32" not in caplog.text
    with pytest.raises(ConfigError, match=r"`quantization='gptq'` needs a checkpoint quantized with it"):
        LLM(str(folder), quantization="gptq", **ENGINE)


def test_quantization_naming_another_method_than_the_checkpoint_is_an_error(tmp_path, tokenizer_dir):
    folder = _tiny(tmp_path, tokenizer_dir, lambda m, f: write_compressed_tensors(m, "W8A8", f))
    with pytest.raises(ConfigError, match=r"`quantization='fp8'` contradicts the checkpoint.*'compressed-tensors'"):
        LLM(str(folder), quantization="fp8", **ENGINE)
    with LLM(str(folder), quantization="compressed-tensors", **ENGINE) as llm:
        assert run(llm)[0]


# The W8A8 and FP8 layouts' saved tensors round-trip in kernels/test_quantized_forms.py.
@pytest.mark.parametrize("write", ["w4a16_asym", pytest.param("w8a8", marks=pytest.mark.slow),
                                   pytest.param("fp8", marks=pytest.mark.slow), "gptq_act_order"])
def test_sharded_state_is_written_quantized_and_loads_back(tmp_path, tokenizer_dir, write):
    from safetensors import safe_open

    writers = {"w4a16_asym": lambda m, f: write_compressed_tensors(m, "W4A16_ASYM", f, group_size=32),
               "w8a8": lambda m, f: write_compressed_tensors(m, "W8A8", f),
               "fp8": lambda m, f: write_compressed_tensors(m, "FP8", f),
               "gptq_act_order": lambda m, f: write_gptq(m, f, bits=4, group_size=32, desc_act=True)}
    folder = _tiny(tmp_path / "src", tokenizer_dir, writers[write])
    saved = tmp_path / "sharded"
    tp = 1 if write == "gptq_act_order" else 2  # act order cannot split by input features
    with LLM(str(folder), tensor_parallel_size=tp, **ENGINE) as llm:
        expected = run(llm)
        llm.save_sharded_state(str(saved))
    with safe_open(str(saved / "model-rank-0-part-0.safetensors"), framework="pt") as f:
        names = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
    assert "model.layers.0.self_attn.qkv_proj.weight" not in names  # no float copy of a quantized layer
    assert qweight.dtype in (torch.uint8, torch.int8)
    with LLM(str(saved), load_format="sharded_state", tensor_parallel_size=tp, **ENGINE) as llm:
        assert_same(run(llm), expected)
