"""`LLM.embed`, `LLM.encode` and `LLM.score` end to end: sentence-transformers' all-MiniLM-L6-v2,
tiny random BERT and decoder checkpoints against transformers' own forward pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.checkpoints import MINILM_INSTALL, _checkpoint, minilm_folder

from ferrollm import LLM, PoolingParams, SamplingParams
from ferrollm import exceptions as exc
from ferrollm.outputs import EmbeddingRequestOutput, PoolingRequestOutput, ScoringRequestOutput


MINILM = minilm_folder()
needs_minilm = pytest.mark.skipif(MINILM is None, reason=MINILM_INSTALL)

SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "The quick brown fox jumps over the lazy dog.",
    "Stock markets fell sharply after the announcement.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy.",
    "The cat sleeps on the warm windowsill.",
    "Paris is the capital of France.",
    "A very long sentence that keeps going, with commas, clauses and subordinate clauses, "
    "so that the batch mixes short and long prompts of quite different lengths.",
]


@torch.no_grad()
def st_mean_pooled(folder: Path, sentences: list[str]) -> torch.Tensor:
    """What sentence-transformers computes for this model (modules.json: Transformer, mean
    Pooling, Normalize), with transformers' forward pass and the pooling written out."""
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder).eval()
    batch = tok(sentences, padding=True, truncation=True, max_length=256, return_tensors="pt")
    hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@needs_minilm
def test_minilm_matches_sentence_transformers_and_scores_paraphrases_higher():
    with LLM(model=str(MINILM)) as llm:
        mc = llm.llm_engine.model_config
        assert (mc.runner_type, mc.pooler.pooling_type, mc.pooler.normalize) == ("pooling", "MEAN", True)
        assert mc.max_model_len == 256  # sentence_bert_config.json's max_seq_length
        outs = llm.embed(SENTENCES, use_tqdm=False)
        scores = llm.score("A man is eating pasta.",
                           ["A man is eating a piece of bread.", "Stock markets fell sharply."], use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    ours = torch.tensor([o.outputs.embedding for o in outs])
    cosine = (ours * st_mean_pooled(MINILM, SENTENCES)).sum(-1)
    assert cosine.min() >= 0.999, cosine
    assert all(isinstance(s, ScoringRequestOutput) for s in scores)
    assert scores[0].outputs.score > scores[1].outputs.score + 0.2


def hf_last_token(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' final hidden state (after the last norm) at the last token, normalized."""
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    return F.normalize(hidden.float(), dim=-1)


PROMPTS = [[5, 17, 33], list(range(3, 40)), [200, 9, 81, 44, 12, 7], list(range(100, 118))]


@pytest.mark.parametrize("option", [{"runner": "pooling"}, {"convert": "embed"}])
def test_decoder_embeddings_are_the_normalized_last_token_state(tiny_llama, option):
    path, hf_model = tiny_llama
    with LLM(model=str(path), **option) as llm:
        mc = llm.llm_engine.model_config
        assert (mc.runner_type, mc.convert_type, mc.pooler.pooling_type) == ("pooling", "embed", "LAST")
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):
        assert o.prompt_token_ids == p
        assert torch.allclose(torch.tensor(o.outputs.embedding), hf_last_token(hf_model, p), atol=1e-4)


@pytest.mark.parametrize("kind", ["mistral_sliding", "gemma2", "qwen3"])
def test_sliding_window_and_other_decoders_embed_long_prompts(kind, tmp_path, tokenizer_dir):
    path, hf_model = _checkpoint(kind, tmp_path / kind, tokenizer_dir)
    with LLM(model=str(path), convert="embed") as llm:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for p, o in zip(PROMPTS, outs):  # prompts up to 37 tokens, windows of 6-7
        assert torch.allclose(torch.tensor(o.outputs.embedding), hf_last_token(hf_model, p), atol=1e-4)


def test_qwen2_embeddings_and_encode_tasks(tiny_qwen2):
    path, hf_model = tiny_qwen2
    prompt = PROMPTS[1]
    with LLM(model=str(path), runner="pooling") as llm:
        (pooled,) = llm.encode([{"prompt_token_ids": prompt}], use_tqdm=False)
        (tokens,) = llm.encode([{"prompt_token_ids": prompt}], use_tqdm=False, pooling_task="token_embed")
        raw = llm.embed([{"prompt_token_ids": prompt}], pooling_params=PoolingParams(normalize=False), use_tqdm=False)
    assert isinstance(pooled, PoolingRequestOutput) and pooled.outputs.data.dtype == torch.float32
    assert torch.allclose(pooled.outputs.data, hf_last_token(hf_model, prompt), atol=1e-4)
    with torch.no_grad():
        every = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
    assert tokens.outputs.data.shape == (len(prompt), hf_model.config.hidden_size)
    assert torch.allclose(tokens.outputs.data, F.normalize(every, dim=-1), atol=1e-4)
    assert torch.allclose(torch.tensor(raw[0].outputs.embedding), every[-1], atol=1e-4)


def test_dimensions_truncate_then_renormalize(tiny_llama):
    path, hf_model = tiny_llama
    prompt = PROMPTS[2]
    with torch.no_grad():
        full = hf_model.model(torch.tensor([prompt])).last_hidden_state[0, -1]
    with LLM(model=str(path), runner="pooling", hf_overrides={"is_matryoshka": True}) as llm:
        short, unnormalized = llm.embed(
            [{"prompt_token_ids": prompt}] * 2, use_tqdm=False,
            pooling_params=[PoolingParams(dimensions=16), PoolingParams(dimensions=16, normalize=False)])
        with pytest.raises(ValueError, match=r"`dimensions` must be <= the model's embedding size \(64\). Given: 65"):
            llm.embed("x", pooling_params=PoolingParams(dimensions=65), use_tqdm=False)
    assert short.outputs.hidden_size == 16
    assert torch.allclose(torch.tensor(short.outputs.embedding), F.normalize(full[:16], dim=-1), atol=1e-4)
    assert torch.allclose(torch.tensor(unnormalized.outputs.embedding), full[:16], atol=1e-4)


def test_matryoshka_dimensions_list_limits_the_choice(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), runner="pooling", hf_overrides={"matryoshka_dimensions": [8, 32]}) as llm:
        assert len(llm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding) == 8
        with pytest.raises(ValueError, match=r"matryoshka_dimensions \[8, 32\]. Given: 16"):
            llm.embed("hello", pooling_params=PoolingParams(dimensions=16), use_tqdm=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(tiny_llama):
    path, hf_model = tiny_llama
    long = PROMPTS[1]
    with LLM(model=str(path), runner="pooling", max_model_len=32) as llm:
        (kept,) = llm.embed([{"prompt_token_ids": long}], truncate_prompt_tokens=5, use_tqdm=False)
        (via_params,) = llm.embed([{"prompt_token_ids": long}], use_tqdm=False,
                                  pooling_params=PoolingParams(truncate_prompt_tokens=5))
        (to_max,) = llm.embed([{"prompt_token_ids": long}], truncate_prompt_tokens=-1, use_tqdm=False)
        text = "the quick brown fox jumps over the lazy dog"
        (text_out,) = llm.embed(text, truncate_prompt_tokens=4, use_tqdm=False)
        tok = llm.get_tokenizer()
        with pytest.raises(exc.PromptTooLongError, match="max_model_len \\(32\\)"):
            llm.embed([{"prompt_token_ids": long}], use_tqdm=False)
        with pytest.raises(ValueError, match=r"`truncate_prompt_tokens` must be <= max_model_len \(32\) or -1. Given: 33"):
            llm.embed("x", truncate_prompt_tokens=33, use_tqdm=False)
    assert kept.prompt_token_ids == long[-5:] == via_params.prompt_token_ids
    assert kept.outputs.embedding == via_params.outputs.embedding
    assert torch.allclose(torch.tensor(kept.outputs.embedding), hf_last_token(hf_model, long[-5:]), atol=1e-4)
    assert to_max.prompt_token_ids == long[-32:]
    # Text prompts are truncated by the tokenizer from the left: BOS stays, then the last words.
    ids = tok(text)["input_ids"]
    assert text_out.prompt_token_ids == [ids[0]] + ids[-3:]


def test_bert_encoder_batches_through_the_scheduler(tiny_bert):
    path, hf_model = tiny_bert
    prompts = [[1, 40, 41, 42], list(range(3, 60)), [1, 7], list(range(90, 120))]
    # max_num_seqs=2: four requests take two steps of the core's scheduler.
    with LLM(model=str(path), max_num_seqs=2) as llm:
        mc = llm.llm_engine.model_config
        assert (mc.runner_type, mc.pooler.pooling_type, mc.pooler.normalize) == ("pooling", "CLS", True)
        outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
        alone = [llm.embed([{"prompt_token_ids": p}], use_tqdm=False)[0] for p in prompts]
    with torch.no_grad():
        for p, o, single in zip(prompts, outs, alone):
            hidden = hf_model(torch.tensor([p])).last_hidden_state[0]
            assert torch.allclose(torch.tensor(o.outputs.embedding), F.normalize(hidden[0], dim=-1), atol=1e-4)
            # Padding inside a batch does not leak into a prompt's result.
            assert torch.allclose(torch.tensor(o.outputs.embedding), torch.tensor(single.outputs.embedding), atol=1e-6)


def test_sentence_transformers_config_and_pooler_config_choose_the_pooling(tiny_bert, tmp_path):
    path, hf_model = tiny_bert
    folder = tmp_path / "st-bert"
    shutil.copytree(path, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    prompt = list(range(3, 20))
    with torch.no_grad():
        hidden = hf_model(torch.tensor([prompt])).last_hidden_state[0]
    with LLM(model=str(folder)) as llm:  # mean pooling, and no Normalize module: not normalized
        assert (llm.llm_engine.model_config.pooler.pooling_type, llm.llm_engine.model_config.pooler.normalize) == ("MEAN", False)
        (mean,) = llm.embed([{"prompt_token_ids": prompt}], use_tqdm=False)
    assert torch.allclose(torch.tensor(mean.outputs.embedding), hidden.mean(0), atol=1e-4)
    with LLM(model=str(folder), pooler_config={"pooling_type": "LAST", "normalize": True}) as llm:
        (last,) = llm.embed([{"prompt_token_ids": prompt}], use_tqdm=False)
    assert torch.allclose(torch.tensor(last.outputs.embedding), F.normalize(hidden[-1], dim=-1), atol=1e-4)


def test_score_pairs_one_to_n_and_n_to_n(tiny_bert):
    path, _ = tiny_bert
    a, b, c = "hello world", "the quick brown fox", "the end"
    with LLM(model=str(path)) as llm:
        emb = {t: torch.tensor(o.outputs.embedding) for t, o in zip((a, b, c), llm.embed([a, b, c], use_tqdm=False))}
        one = llm.score(a, b, use_tqdm=False)
        one_to_n = llm.score(a, [b, c], use_tqdm=False)
        n_to_n = llm.score([a, b], [c, a], use_tqdm=False)
        with pytest.raises(ValueError, match="1:1, 1:N or N:N. Given: 2 and 3"):
            llm.score([a, b], [a, b, c], use_tqdm=False)

    def cos(x, y):
        return float(F.cosine_similarity(emb[x], emb[y], dim=0))

    assert len(one) == 1 and one[0].outputs.score == pytest.approx(cos(a, b), abs=1e-5)
    assert [s.outputs.score for s in one_to_n] == pytest.approx([cos(a, b), cos(a, c)], abs=1e-5)
    assert [s.outputs.score for s in n_to_n] == pytest.approx([cos(a, c), cos(b, a)], abs=1e-5)
    assert one_to_n[1].request_id.count("_") == 1


def test_generate_and_embed_name_the_option_to_use(tiny_llama, tiny_bert):
    with LLM(model=str(tiny_llama[0])) as llm:
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.embed("hello", use_tqdm=False)
        with pytest.raises(ValueError, match="runner='pooling'"):
            llm.score("a", "b", use_tqdm=False)
    with LLM(model=str(tiny_llama[0]), runner="pooling") as llm:
        with pytest.raises(ValueError, match="LLM.generate\\(\\) needs a generative model.*without runner='pooling'"):
            llm.generate("hello", use_tqdm=False)
    with LLM(model=str(tiny_bert[0])) as llm:
        with pytest.raises(ValueError, match="BertModel is an encoder-only model"):
            llm.generate("hello", use_tqdm=False)
        with pytest.raises(ValueError, match="`pooling_params` must be PoolingParams. Given: SamplingParams"):
            llm.embed("hello", pooling_params=SamplingParams(), use_tqdm=False)
        with pytest.raises(ValueError, match="`dimensions` needs a model trained with Matryoshka"):
            llm.embed("hello", pooling_params=PoolingParams(dimensions=8), use_tqdm=False)
        with pytest.raises(ValueError, match="`pooling_task` must be one of"):
            llm.encode("hello", pooling_task="classify", use_tqdm=False)
        assert len(llm.embed("still usable", use_tqdm=False)[0].outputs.embedding) == 64
    with pytest.raises(exc.ConfigError, match="`runner` must be 'pooling'"):
        LLM(model=str(tiny_bert[0]), runner="generate")
    with pytest.raises(exc.ConfigError, match="`runner` must be one of"):
        LLM(model=str(tiny_bert[0]), runner="embed")
