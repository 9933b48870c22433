"""Two gloo ranks on the CPU: sharded layers, all-reduce and the LM head's all-gather must give
what one rank gives."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
import transformers
from helpers.engine_driver import TINY, build_checkpoint, load_ferrollm_model, make_prompts, run_engine
from helpers.tp_worker import run_rank

MAX_TOKENS = 6


def test_two_ranks_match_one(tmp_path):
    folders = [tmp_path / "llama", tmp_path / "qwen2_one_kv_head"]
    build_checkpoint("llama", folders[0])
    # One KV head for two ranks: each rank holds a replica of it.
    torch.manual_seed(0)
    qwen = transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**{**TINY, "num_key_value_heads": 1}, tie_word_embeddings=True))
    qwen.save_pretrained(folders[1])
    prompts = make_prompts(4, seed=3, vocab=TINY["vocab_size"], max_len=20)

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(run_rank, nprocs=2, join=True,
             args=(2, str(tmp_path / "store"), [str(f) for f in folders], prompts, MAX_TOKENS, str(out_dir)))

    for i, folder in enumerate(folders):
        single = run_engine(load_ferrollm_model(folder), prompts, MAX_TOKENS)
        sharded = torch.load(out_dir / f"{i}.pt")
        assert sharded["tokens"] == single.tokens, folder.name
        for req, logits in single.logits.items():
            torch.testing.assert_close(torch.stack(sharded["logits"][req]), torch.stack(logits),
                                       atol=1e-4, rtol=0)
