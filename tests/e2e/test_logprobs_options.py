"""vLLM's logprob options end to end on a tiny checkpoint, against transformers' forward pass:
`max_logprobs`, `logprobs_mode`, ranks, flat logprobs, `detokenize=False` and `bad_words`."""

from __future__ import annotations

import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm.exceptions import ConfigError
from ferrollm.logprobs import FlatLogprobs

PROMPT = [1, 17, 42, 99, 7, 250, 31]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def hf_logits(hf_model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([seq])).logits[0].float()


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path)) as llm:
        yield llm


def run(llm, params):
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]


def test_max_logprobs_limits_sample_and_prompt_logprobs_with_vllms_wording(llm):
    with pytest.raises(ValueError, match=r"Requested sample logprobs of 21, which is greater than max allowed: 20"):
        run(llm, greedy(1, logprobs=21))
    with pytest.raises(ValueError, match=r"Requested prompt logprobs of 384, which is greater than max allowed: 20.*Given: -1"):
        run(llm, greedy(1, prompt_logprobs=-1))
    assert len(run(llm, greedy(1, logprobs=20)).outputs[0].logprobs[0]) >= 20


def test_max_logprobs_minus_one_allows_the_whole_vocabulary(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match="max_logprobs"):
        LLM(model=str(path), max_logprobs=-2)
    with LLM(model=str(path), max_logprobs=-1) as llm:
        out = run(llm, greedy(1, logprobs=-1, prompt_logprobs=-1))
    assert len(out.outputs[0].logprobs[0]) == 384
    assert len(out.prompt_logprobs[1]) == 384


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_raw_modes_return_the_models_values(tiny_llama, mode):
    path, hf_model = tiny_llama
    with LLM(model=str(path), logprobs_mode=mode) as llm:
        # Penalties and a bias change the sampled token but not raw values.
        out = run(llm, greedy(3, logprobs=3, prompt_logprobs=2, repetition_penalty=1.5, logit_bias={5: 3.0}))
    c = out.outputs[0]
    ref = hf_logits(hf_model, PROMPT + list(c.token_ids))
    if mode == "raw_logprobs":
        ref = ref.log_softmax(-1)
    for j, entry in enumerate(c.logprobs):
        row = ref[len(PROMPT) - 1 + j]
        for tid, lp in entry.items():
            assert lp.logprob == pytest.approx(row[tid].item(), abs=1e-3)
            assert lp.rank == int((row >= row[tid]).sum()) or lp.rank <= 3
    for i in range(1, len(PROMPT)):
        assert out.prompt_logprobs[i][PROMPT[i]].logprob == pytest.approx(ref[i - 1, PROMPT[i]].item(), abs=1e-3)


def test_processed_modes_see_temperature_and_top_k(tiny_llama):
    path, hf_model = tiny_llama
    params = SamplingParams(max_tokens=3, temperature=0.7, top_k=5, seed=3, ignore_eos=True, logprobs=6,
                            prompt_logprobs=0)
    results, prompt_results = {}, {}
    for mode in ("processed_logits", "processed_logprobs"):
        with LLM(model=str(path), logprobs_mode=mode) as llm:
            out = run(llm, params)
        results[mode], prompt_results[mode] = out.outputs[0], out.prompt_logprobs
    c = results["processed_logits"]
    assert c.token_ids == results["processed_logprobs"].token_ids, "the mode changes what is returned only"
    ref = hf_logits(hf_model, PROMPT + list(c.token_ids))
    for j in range(3):
        row = ref[len(PROMPT) - 1 + j] / 0.7
        kept = row.topk(5).indices
        filtered = torch.full_like(row, float("-inf"))
        filtered[kept] = row[kept]
        logits_entry, logprobs_entry = c.logprobs[j], results["processed_logprobs"].logprobs[j]
        for tid in kept.tolist():
            assert logits_entry[tid].logprob == pytest.approx(filtered[tid].item(), abs=1e-3)
            assert logprobs_entry[tid].logprob == pytest.approx(filtered.log_softmax(-1)[tid].item(), abs=1e-3)
        # The sixth entry is outside top-k: -inf, numbered 6 by position.
        sixth = [lp for lp in logits_entry.values() if lp.rank == 6]
        assert sixth and sixth[0].logprob == float("-inf")
    # Nothing processes prompt logits: the processed modes give the raw values there.
    raw = ref[:len(PROMPT) - 1]
    for mode, values in (("processed_logits", raw), ("processed_logprobs", raw.log_softmax(-1))):
        out = prompt_results[mode]
        for i in range(1, len(PROMPT)):
            assert out[i][PROMPT[i]].logprob == pytest.approx(values[i - 1, PROMPT[i]].item(), abs=1e-3)


def test_tied_values_get_distinct_ranks_by_position(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), logprobs_mode="processed_logprobs") as llm:
        c = run(llm, greedy(1, logprobs=3, allowed_token_ids=[42])).outputs[0]
    entry = c.logprobs[0]
    assert entry[42].rank == 1 and entry[42].logprob == 0.0
    assert sorted(lp.rank for lp in entry.values()) == [1, 2, 3]  # two -inf tokens tie, ranked 2 and 3


def test_sampled_token_rank_is_counted_when_outside_the_top_k(llm, tiny_llama):
    _, hf_model = tiny_llama
    ref = hf_logits(hf_model, PROMPT)[-1]
    forced = int(ref.argsort(descending=True)[7])  # the 8th likeliest token
    c = run(llm, greedy(1, logprobs=2, allowed_token_ids=[forced])).outputs[0]
    entry = c.logprobs[0]
    assert list(entry)[0] == forced and entry[forced].rank == 8
    assert sorted(lp.rank for t, lp in entry.items() if t != forced) == [1, 2]


def test_flat_logprobs_hold_what_the_dicts_hold(llm):
    params = dict(logprobs=4, prompt_logprobs=2)
    plain = run(llm, greedy(5, **params))
    flat = run(llm, greedy(5, flat_logprobs=True, **params))
    assert isinstance(flat.outputs[0].logprobs, FlatLogprobs)
    assert isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert list(flat.outputs[0].logprobs) == plain.outputs[0].logprobs
    assert flat.prompt_logprobs[0] == {} and plain.prompt_logprobs[0] is None
    assert list(flat.prompt_logprobs)[1:] == plain.prompt_logprobs[1:]
    assert flat.outputs[0].cumulative_logprob == pytest.approx(plain.outputs[0].cumulative_logprob)


def test_detokenize_false_leaves_decoded_tokens_none(llm):
    out = run(llm, greedy(3, logprobs=2, prompt_logprobs=1, detokenize=False))
    assert all(lp.decoded_token is None for e in out.outputs[0].logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in out.prompt_logprobs[1:] for lp in e.values())
    assert out.outputs[0].text == ""


def test_prompt_tokens_of_a_split_character_decode_as_vllm_does(llm):
    tok = llm.llm_engine.tokenizers.core
    text = "你好，世界。"
    ids = tok.encode(text, add_special_tokens=False)
    out = llm.generate([{"prompt_token_ids": [1] + ids}], greedy(1, prompt_logprobs=0), use_tqdm=False)[0]
    decoded = [e[t].decoded_token for e, t in zip(out.prompt_logprobs[1:], ids)]
    assert "".join(decoded) == text
    assert all("\ufffd" not in d for d in decoded)
    assert "" in decoded, "a character spread over tokens shows on its last one"


def _contains(seq, sub) -> bool:
    return any(list(seq[i:i + len(sub)]) == list(sub) for i in range(len(seq) - len(sub) + 1))


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    base = list(run(llm, greedy(12)).outputs[0].token_ids)
    # A word of the greedy output (two tokens if one round-trips, else one) that
    # re-tokenizes to the same ids.
    words = [base[i:i + n] for n in (2, 1) for i in range(len(base) - n + 1)]
    ids = next(w for w in words if "\ufffd" not in tok.decode(w) and tok.decode(w).strip()
               and tok.encode(tok.decode(w).lstrip(), add_special_tokens=False) == w)
    word = tok.decode(ids)
    out = list(run(llm, greedy(12, bad_words=[word])).outputs[0].token_ids)
    assert not _contains(out, ids)
    assert out != base


def test_a_bad_word_blocks_its_last_token_only_after_its_prefix():
    from ferrollm.worker.model_runner import _bad_word_ids
    from ferrollm.worker.request_state import CachedRequestState

    p = SamplingParams(bad_words=["w"])
    p._bad_words_token_ids = [[5, 6, 7], [9]]
    state = CachedRequestState("r", p, [1, 2], output_token_ids=[3, 5])
    assert _bad_word_ids([state]) == [[9]]  # a one-token word is always blocked
    state.output_token_ids.append(6)
    assert _bad_word_ids([state]) == [[7, 9]]
    state.output_token_ids.append(7)
    assert _bad_word_ids([state]) == [[9]]


def test_bad_words_and_extra_args_are_validated():
    with pytest.raises(ValueError, match="bad_words cannot contain an empty string"):
        SamplingParams(bad_words=["ok", ""])
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=["not", "a", "dict"])  # type: ignore[arg-type]
    assert SamplingParams(bad_words=["a", "a", "b"]).bad_words == ["a", "b"]
    assert SamplingParams(extra_args={"k": 1}).extra_args == {"k": 1}


def test_bad_words_tokenize_with_and_without_a_leading_space():
    class Tok:
        vocab = {"foo": [5], " foo": [6], "bar baz": [7, 8], " bar baz": [9, 8], "x": [3], " x": [4, 3]}

        def encode(self, text, add_special_tokens=False):
            return self.vocab[text]

    p = SamplingParams(bad_words=["foo", " bar baz", "x"])
    p.update_from_tokenizer(Tok())
    # " x" tokenizes longer than "x": a different word, not added.
    assert p.bad_words_token_ids == [[5], [6], [7, 8], [9, 8], [3]]
