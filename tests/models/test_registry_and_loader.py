"""The model registry and the safetensors loader's errors and layouts."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.engine_driver import TINY, build_checkpoint

from ferrollm.exceptions import CheckpointError, ConfigError, UnsupportedModelError
from ferrollm.model_executor.layers.cpu_weights import cpu_weight_form
from ferrollm.model_executor.loader import get_model, iterate_safetensors
from ferrollm.model_executor.sharded_state import dense_state_dict
from ferrollm.model_executor.models.llama import LlamaForCausalLM
from ferrollm.model_executor.models.qwen2 import Qwen2ForCausalLM
from ferrollm.model_executor.registry import ModelRegistry


def test_registry_resolves_the_first_supported_architecture():
    assert ModelRegistry.resolve(["LlamaForCausalLM"]) is LlamaForCausalLM
    assert ModelRegistry.resolve(["Unknown", "Qwen2ForCausalLM"]) is Qwen2ForCausalLM


def test_unknown_architecture_names_it_and_suggests_hf_overrides():
    with pytest.raises(UnsupportedModelError) as info:
        ModelRegistry.resolve(["MambaForCausalLM"])
    message = str(info.value)
    assert "MambaForCausalLM" in message and "LlamaForCausalLM" in message
    assert 'hf_overrides={"architectures"' in message
    assert isinstance(info.value, ConfigError) and isinstance(info.value, ValueError)


def test_registered_architecture_is_imported_lazily(monkeypatch):
    monkeypatch.setattr(ModelRegistry, "_models", dict(ModelRegistry._models))
    ModelRegistry.register_model("MyLlama", "ferrollm.model_executor.models.llama:LlamaForCausalLM")
    assert ModelRegistry.resolve(["MyLlama"]) is LlamaForCausalLM
    assert "MyLlama" in ModelRegistry.get_supported_archs()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_checkpoint("llama", folder)
    return folder


def test_sharded_checkpoint_yields_the_same_tensors(llama_dir, tmp_path):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    single = dict(iterate_safetensors(llama_dir))
    sharded = dict(iterate_safetensors(tmp_path))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)


def test_folder_without_safetensors_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        list(iterate_safetensors(tmp_path))


def config_of(folder):
    return transformers.AutoConfig.from_pretrained(folder)


def test_missing_tensor_is_reported(llama_dir):
    weights = [(k, v) for k, v in iterate_safetensors(llama_dir) if "layers.1.self_attn.v_proj" not in k]
    with pytest.raises(CheckpointError, match="qkv_proj.weight', 'v'"):
        get_model(config_of(llama_dir), torch.float32, weights)


def test_unexpected_tensor_is_reported(llama_dir):
    weights = list(iterate_safetensors(llama_dir)) + [("model.extra.weight", torch.zeros(2))]
    with pytest.raises(CheckpointError, match="model.extra.weight"):
        get_model(config_of(llama_dir), torch.float32, weights)


def test_config_that_does_not_match_the_weights_is_reported(llama_dir):
    config = config_of(llama_dir)
    config.intermediate_size = TINY["intermediate_size"] * 2
    with pytest.raises(CheckpointError, match="shape"):
        get_model(config, torch.float32, iterate_safetensors(llama_dir))


def test_get_model_exposes_kv_cache_spec_and_eval_mode(llama_dir):
    model = get_model(config_of(llama_dir), torch.float32, iterate_safetensors(llama_dir))
    assert not model.training
    assert model.kv_cache_spec() == (2, 2, TINY["hidden_size"] // TINY["num_attention_heads"])


def test_readme_lists_exactly_the_registered_architectures():
    from pathlib import Path

    from ferrollm.model_executor.registry import architectures_markdown

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = readme.split("<!-- architectures:start -->\n")[1].split("<!-- architectures:end -->")[0]
    assert block == architectures_markdown(), "run: python -m ferrollm.model_executor.registry README.md"


def _mapped_file(tensor: torch.Tensor) -> str | None:
    """The file whose mapping holds ``tensor``'s memory, from /proc/self/maps (None: anonymous)."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5] if len(fields) > 5 else None
    return None


def _checkpoint_file(llama_dir) -> str:
    return str((llama_dir / "model.safetensors").resolve())


def _form_tensors(layer) -> list[torch.Tensor]:
    """The tensors a linear layer's CPU form computes from."""
    form = layer._cpu
    return [form.weight]


@pytest.mark.parametrize("gemm", ["default", "portable"])
def test_each_weight_is_held_once_in_the_form_its_products_read(llama_dir, monkeypatch, gemm):
    if gemm == "portable":
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")
    model = get_model(config_of(llama_dir), torch.float32, iterate_safetensors(llama_dir))
    layer = model.model.layers[0]
    form = cpu_weight_form(torch.device("cpu"), torch.float32)
    assert _mapped_file(layer.input_layernorm.weight) == _checkpoint_file(llama_dir)
    for linear, viewed in ((layer.self_attn.qkv_proj, False), (layer.mlp.gate_up_proj, True),
                           (layer.mlp.down_proj, True)):
        # The parameter keeps only its shape; the form holds the weight.
        assert linear.weight.device.type == "meta"
        files = {_mapped_file(t) for t in _form_tensors(linear)}
        # Plain rows stay views of the checkpoint's mapping where the file holds them back to
        # back (gate/up, a whole tensor); q/k/v are merged into one copy; packed panels are the
        # only copy.
        if form == "rows" and viewed:
            assert files == {_checkpoint_file(llama_dir)}, files
        else:
            assert _checkpoint_file(llama_dir) not in files, (form, files)
    stored = dict(iterate_safetensors(llama_dir))
    for name, tensor in dense_state_dict(model).items():
        if name in stored:
            assert torch.equal(tensor, stored[name]), name


def test_writes_to_a_shared_weight_stay_in_the_process(llama_dir):
    model = get_model(config_of(llama_dir), torch.float32, iterate_safetensors(llama_dir))
    name = "model.layers.0.input_layernorm.weight"
    before = dict(iterate_safetensors(llama_dir))[name].clone()
    with torch.no_grad():
        model.get_parameter(name).fill_(7.0)
    assert torch.equal(dict(iterate_safetensors(llama_dir))[name], before)
    assert (llama_dir / "model.safetensors").stat().st_size > 0


@pytest.mark.parametrize("how", ["caller's tensors", "switched off", "other dtype"])
def test_weights_are_copied_when_they_may_not_be_shared(llama_dir, monkeypatch, how):
    dtype = torch.bfloat16 if how == "other dtype" else torch.float32
    weights = iterate_safetensors(llama_dir)
    if how == "caller's tensors":
        weights = [(k, v.clone()) for k, v in weights]
    if how == "switched off":
        monkeypatch.setenv("FERROLLM_SHARE_CHECKPOINT_MEMORY", "0")
    model = get_model(config_of(llama_dir), dtype, weights)
    down = model.model.layers[0].mlp.down_proj.dense_weight()
    assert _mapped_file(down) != _checkpoint_file(llama_dir)
    if how == "caller's tensors":
        source = dict(weights)["model.layers.0.mlp.down_proj.weight"]
        assert down.data_ptr() != source.data_ptr() and torch.equal(down, source)
