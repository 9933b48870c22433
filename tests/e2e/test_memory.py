"""Memory, measured with the process's own counters (never timing): each case runs in a fresh
process, so its peak resident set (VmHWM) is the engine's alone.

- Loading and running a model holds its weights about once: the CPU weight forms keep one copy
  (views of the checkpoint's mapping here), where the engine used to keep the loaded tensor, a
  merged copy and a packed copy.
- `max_num_seqs` bounds a step's tokens (and so its activations), and `max_model_len` the tables
  sized by position (RoPE's cos/sin), so lowering either lowers the peak.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers.checkpoints import add_tokenizer

MIB = 1 << 20

# Runs LLM(model, **kwargs) on `num_prompts` prompts of `prompt_len` tokens -> 4 tokens and
# prints the resident set after import, the peak, and the checkpoint's bytes.
_SCRIPT = r"""
import json, sys
from pathlib import Path
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from ferrollm import LLM, SamplingParams
base = status("VmRSS")
path, kwargs, num_prompts, prompt_len = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with LLM(model=path, **kwargs) as llm:
    prompts = [{"prompt_token_ids": [5 + (i * 7 + j) % 200 for j in range(prompt_len)]} for i in range(num_prompts)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    peak = status("VmHWM")
weights = sum(p.stat().st_size for p in Path(path).glob("*.safetensors"))
print(json.dumps({"base": base, "peak": peak, "weights": weights}))
"""


def _measure(path: Path, num_prompts: int = 4, prompt_len: int = 32, **kwargs) -> dict:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(path), json.dumps(kwargs), str(num_prompts),
                          str(prompt_len)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FERROLLM_CONFIGURE_LOGGING": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _llama(folder: Path, tokenizer_dir: Path, num_layers: int) -> Path:
    """A Llama of ~25 MiB of fp32 weights a layer (large enough that a second copy would show),
    with RoPE positions far past what the tests run."""
    config = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    add_tokenizer(folder, tokenizer_dir)
    return folder


@pytest.fixture(scope="module")
def mid_llama(tmp_path_factory, tokenizer_dir) -> Path:
    return _llama(tmp_path_factory.mktemp("mid-llama"), tokenizer_dir, num_layers=2)


def test_running_a_model_holds_its_weights_once(mid_llama, tmp_path, tokenizer_dir):
    # Two models that differ only in depth: whatever the engine holds beside the weights (the
    # transformers modules the config needs, ~64 MiB; library pages; the runner) is the same for
    # both, so the peaks differ by what the extra layers cost: one copy of their weights (60 MiB)
    # and ~5 MiB a layer of runtime state (measured 1.31x the weights). The loaded tensor, a merged
    # copy and a packed copy, as before, measured 3.0x.
    deep = _llama(tmp_path / "deep", tokenizer_dir, num_layers=6)
    shallow_run, deep_run = _measure(mid_llama, max_model_len=256), _measure(deep, max_model_len=256)
    extra_weights = deep_run["weights"] - shallow_run["weights"]
    assert deep_run["peak"] - shallow_run["peak"] <= 1.5 * extra_weights, (shallow_run, deep_run)
    # And in all, the weights plus that fixed part (~150 MiB here, most of it not ferrollm's, and
    # ~110 MiB more where torchvision is installed, as `make test` installs it: transformers 5's
    # LlamaConfig module imports its image utilities, which import torchvision, torch._dynamo and
    # triton; measured 335 against 221 MiB of growth with and without torchvision).
    assert deep_run["peak"] - deep_run["base"] <= deep_run["weights"] + 300 * MIB, deep_run


def test_a_smaller_max_num_seqs_lowers_the_peak(mid_llama):
    # 32 prompts of 256 tokens: with 32 sequences at once a prefill step holds 8192 tokens'
    # activations (~100 MiB here); with 2, 512 tokens'.
    big = _measure(mid_llama, num_prompts=32, prompt_len=256, max_model_len=512, max_num_seqs=32)
    small = _measure(mid_llama, num_prompts=32, prompt_len=256, max_model_len=512, max_num_seqs=2)
    assert small["peak"] < big["peak"] - 32 * MIB, (small, big)


def test_a_smaller_max_model_len_lowers_the_peak(mid_llama):
    # The 131072-position cos/sin table of a 128-wide head is 64 MiB in fp32; 512 positions, 0.25.
    long = _measure(mid_llama, max_model_len=131072)
    short = _measure(mid_llama, max_model_len=512)
    assert short["peak"] < long["peak"] - 32 * MIB, (short, long)


def test_start_up_logs_its_phases_and_the_memory_it_holds(tiny_llama, caplog, monkeypatch):
    import logging

    from ferrollm import LLM

    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", "0.01")
    logger = logging.getLogger("ferrollm")
    logger.addHandler(caplog.handler)  # the ferrollm logger does not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(model=str(tiny_llama[0]), max_num_seqs=4):
            pass
    finally:
        logger.removeHandler(caplog.handler)
    lines = [r.getMessage() for r in caplog.records]
    startup = next(line for line in lines if line.startswith("start-up took"))
    assert all(phase in startup for phase in ("config", "tokenizer", "weights", "KV cache")), startup
    memory = next(line for line in lines if line.startswith("memory: weights"))
    assert "MiB of them mapped from the checkpoint file" in memory and "max_num_seqs=4" in memory, memory
    # The cache is the 0.01 GiB asked for, never more.
    kv_mib = float(memory.split("KV cache ")[1].split(" MiB")[0])
    assert kv_mib <= 0.01 * 1024, memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_table_is_held_once_and_still_answers_like_transformers(tmp_path, tokenizer_dir, caplog, dtype):
    # The LM head's packed form is the table's one copy; the embedding reads its rows there. With
    # a 16384 x 256 table beside one small layer, a second copy would double the logged weights.
    import logging

    from helpers.engine_driver import hf_greedy

    from ferrollm import LLM, SamplingParams

    config = transformers.LlamaConfig(
        vocab_size=16384, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    hf_model.save_pretrained(tmp_path)
    add_tokenizer(tmp_path, tokenizer_dir)
    file_bytes = sum(p.stat().st_size for p in tmp_path.glob("*.safetensors"))
    hf_model.generation_config.eos_token_id = None
    prompt = [5, 17, 300, 9000, 16383, 42]
    want, _ = hf_greedy(hf_model, prompt, 6)

    logger = logging.getLogger("ferrollm")
    logger.addHandler(caplog.handler)  # the ferrollm logger does not propagate to the root
    try:
        with caplog.at_level(logging.INFO, logger="ferrollm"), \
                LLM(model=str(tmp_path), dtype=dtype, max_model_len=64, max_num_seqs=2) as llm:
            out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=6, temperature=0,
                                                                            ignore_eos=True), use_tqdm=False)
    finally:
        logger.removeHandler(caplog.handler)
    memory = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: weights"))
    held = float(memory.split("memory: weights ")[1].split(" MiB")[0]) * MIB
    assert held <= 1.05 * file_bytes, (memory, file_bytes)
    if dtype == torch.float32:  # bf16 sums round differently from transformers': not a token check
        assert list(out[0].outputs[0].token_ids) == want
