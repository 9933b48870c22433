"""TP=2 on the CPU (two processes, gloo) generates what TP=1 generates, for every architecture."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers.checkpoints import add_tokenizer, checkpoint_with_tokenizer
from helpers.engine_driver import CONFIGS, MORE_CONFIGS, TINY
from helpers.tp_cases import assert_same, run

from ferrollm import LLM
from ferrollm.exceptions import ConfigError

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64)


def _compare(folder) -> None:
    with LLM(str(folder), tensor_parallel_size=1, **ENGINE) as llm:
        single = run(llm)
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as llm:
        sharded = run(llm)
    assert_same(sharded, single)


@pytest.mark.parametrize("arch", [*CONFIGS, *MORE_CONFIGS])
def test_two_ranks_generate_what_one_does(arch, tmp_path, tokenizer_dir):
    _compare(checkpoint_with_tokenizer(arch, tmp_path / arch, tokenizer_dir))


def test_one_kv_head_replicated_and_a_padded_vocabulary(tmp_path, tokenizer_dir):
    # One KV head for two ranks (each holds a replica); 390 rows pad to 512 over two ranks.
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 1, "vocab_size": 390})
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    add_tokenizer(tmp_path, tokenizer_dir)
    _compare(tmp_path)


def test_heads_that_do_not_split_are_refused_before_any_process_starts(tiny_llama):
    with pytest.raises(ConfigError, match=r"`num_attention_heads` \(4\) must be divisible by `tensor_parallel_size` \(3\)"):
        LLM(str(tiny_llama[0]), tensor_parallel_size=3, max_model_len=128)


def test_two_ranks_with_async_scheduling_generate_what_one_does(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), tensor_parallel_size=1, **ENGINE) as llm:
        single = run(llm)
    with LLM(str(path), tensor_parallel_size=2, async_scheduling=True, **ENGINE) as llm:
        assert_same(run(llm), single)
