"""A model whose every layer slides (Mistral) runs with KV blocks freed behind the window:
sequences far longer than the cache could hold whole still match transformers."""

from __future__ import annotations

import torch
from helpers.checkpoints import _checkpoint

from ferrollm import LLM, SamplingParams


def _greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_mistral_window_frees_blocks_and_matches_transformers(tmp_path, tokenizer_dir, monkeypatch):
    path, hf_model = _checkpoint("mistral_sliding", tmp_path / "mistral", tokenizer_dir)
    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    # 96 tokens of cache for 4 sequences that each grow to 70 tokens: only freeing blocks behind
    # the 7-token window lets them all run at once.
    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", str(96 * per_token / (1 << 30)))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 380, (n,), generator=g).tolist() for n in (10, 20, 30, 40)]
    with LLM(model=str(path), max_model_len=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.llm_engine.core.stats()["num_free_blocks"] < 4 * 70 // 4
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert llm.llm_engine.core.stats()["num_preemptions"] == 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == _greedy(hf_model, p, 30)
