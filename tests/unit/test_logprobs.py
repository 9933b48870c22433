"""`ferrollm.logprobs` (vLLM's `Logprob` / `FlatLogprobs` and how a position's entries are
numbered) and the decoded text of logprob entries, on the test tokenizer whose CJK characters
span several byte-level tokens."""

from __future__ import annotations

import numpy as np
import pytest

import ferrollm
from ferrollm.entrypoints.logprob_text import LogprobTextDecoder, _read_marker, _restore_leading_spaces
from ferrollm.entrypoints.output_builder import LogprobDecoder
from ferrollm.logprobs import FlatLogprobs, Logprob, append_logprobs_for_next_position, create_prompt_logprobs
from ferrollm.sampling_params import SamplingParams


def test_top_k_is_numbered_by_position_and_a_repeated_chosen_token_takes_its_top_k_rank():
    as_list: list = []
    flat = FlatLogprobs()
    # The chosen token 5 ties with 7 (counted rank 2) and is also the second top-k entry.
    for container in (as_list, flat):
        append_logprobs_for_next_position(container, [5, 7, 5], [-0.5, -0.5, -0.5], ["a", "b", "a"], 2)
    entry = as_list[0]
    assert list(entry) == [5, 7]
    assert entry[7] == Logprob(-0.5, 1, "b")
    assert entry[5] == Logprob(-0.5, 2, "a")
    assert flat[0] == entry
    assert flat.ranks == [2, 1, 2] and flat.token_ids == [5, 7, 5]


def test_chosen_token_outside_the_top_k_keeps_its_counted_rank():
    out: list = []
    append_logprobs_for_next_position(out, [9, 3, 4], [-4.0, -0.1, -0.2], [None] * 3, 17)
    assert [(t, lp.rank) for t, lp in out[0].items()] == [(9, 17), (3, 1), (4, 2)]


def test_flat_logprobs_reads_like_a_list_of_dicts():
    positions = [None, {1: Logprob(-0.1, 1, "x")}, {2: Logprob(-0.2, 3, "y"), 4: Logprob(-0.05, 1, "z")}]
    flat = FlatLogprobs()
    flat.extend(positions)
    assert len(flat) == 3
    assert list(flat) == [{}, positions[1], positions[2]]
    assert flat[-1] == positions[2]
    tail = flat[1:]
    assert isinstance(tail, FlatLogprobs) and list(tail) == positions[1:]
    assert tail.start_indices == [0, 1] and tail.end_indices == [1, 3]
    assert list(flat[::2]) == [{}, positions[2]]
    assert len(flat[5:]) == 0
    with pytest.raises(TypeError):
        flat[0] = {}
    with pytest.raises(TypeError):
        del flat[0]
    with pytest.raises(TypeError):
        flat.insert(0, None)


def test_prompt_container_starts_with_none():
    assert create_prompt_logprobs(False) == [None]
    flat = create_prompt_logprobs(True)
    assert isinstance(flat, FlatLogprobs) and len(flat) == 1 and flat[0] == {}


def test_logprob_is_importable_from_outputs_and_the_package():
    from ferrollm.outputs import Logprob as FromOutputs

    assert FromOutputs is Logprob and ferrollm.Logprob is Logprob


# -- decoded tokens ------------------------------------------------------------------------------


def _split_char(tokenizer: ferrollm.Tokenizer) -> tuple[str, list[int]]:
    """A character of the test corpus that tokenizes to 2+ tokens, each partial alone."""
    for ch in "你好世界今天气很们去公园散步吧🙂😀🚀🎉":
        ids = tokenizer.encode(ch, add_special_tokens=False)
        if len(ids) >= 2 and all(tokenizer.decode([i]).endswith("\ufffd") for i in ids[:-1]):
            return ch, ids
    pytest.skip("the test tokenizer keeps every character whole")


def test_partial_character_tokens_decode_empty_and_the_last_one_gives_the_character(tokenizer):
    ch, ids = _split_char(tokenizer)
    prefix = tokenizer.encode("Hello", add_special_tokens=False)
    decoder = LogprobTextDecoder(tokenizer)
    chosen = prefix + ids
    texts = [decoder.texts([t], chosen[max(0, i - 4):i])[0] for i, t in enumerate(chosen)]
    assert texts[len(prefix):] == [""] * (len(ids) - 1) + [ch]
    assert "".join(texts) == "Hello" + ch


def test_alternatives_at_a_position_are_completed_with_the_chosen_context(tokenizer):
    ch, ids = _split_char(tokenizer)
    decoder = LogprobDecoder(tokenizer)
    # Position 1 chose the last piece; an alternative that is a partial piece alone decodes "".
    entries = [(np.array([ids[0]]), np.array([-0.1]), 1),
               (np.array([ids[1], ids[0]]), np.array([-0.2, -0.3]), 1)]
    out = decoder.build(entries, ids[:2], SamplingParams(logprobs=1), [])
    assert out[0][ids[0]].decoded_token == ""
    second = out[1]
    if len(ids) == 2:
        assert second[ids[1]].decoded_token == ch
    assert all(lp.decoded_token is not None for lp in second.values())


def test_detokenize_false_gives_no_decoded_tokens(tokenizer):
    decoder = LogprobDecoder(tokenizer)
    entries = [(np.array([5, 6]), np.array([-0.1, -0.2]), 2)]
    out = decoder.build(entries, [5], SamplingParams(logprobs=1, detokenize=False), FlatLogprobs())
    assert out.decoded_tokens == [None, None]


def test_sentencepiece_pieces_get_their_leading_space_back():
    assert _restore_leading_spaces("\u2581Hello", "Hello", "\u2581") == " Hello"
    assert _restore_leading_spaces("\u2581Hello", " Hello", "\u2581") == " Hello"
    assert _restore_leading_spaces("Hello", "Hello", "\u2581") == "Hello"
    assert _restore_leading_spaces("\u2581Hello", "Hello", None) == "Hello"


def test_marker_is_read_from_a_metaspace_pre_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()

    class Hf:
        backend_tokenizer = tok

    assert _read_marker(Hf()) == "\u2581"
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(), pre_tokenizers.Metaspace()])
    assert _read_marker(Hf()) == "\u2581"
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert _read_marker(Hf()) is None
    assert _read_marker(None) is None


class _FakeTokenizer:
    """Decodes from a table; anything else is a lone replacement character."""

    def __init__(self, table: dict[tuple[int, ...], str]):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return self.table.get(tuple(ids), "\ufffd")

    def id_to_token(self, token_id):
        return f"t{token_id}"


def test_text_of_a_partial_context_token_moves_to_the_completing_one():
    # Token 44 is a space plus the first bytes of a quote; 48 ends the quote.
    tok = _FakeTokenizer({(44,): " \ufffd", (1385,): " term", (1385, 44): " term \ufffd",
                          (44, 48): " \u201c", (1385, 44, 48): " term \u201c"})
    decoder = LogprobTextDecoder(tok)  # type: ignore[arg-type]
    assert decoder.texts([44], [1385]) == [""]
    assert decoder.texts([48], [1385, 44]) == [" \u201c"]


def test_context_grows_until_the_character_completes_and_gives_up_after_four():
    tok = _FakeTokenizer({(80, 81, 82): "\u201c", (5,): "a"})
    decoder = LogprobTextDecoder(tok)  # type: ignore[arg-type]
    assert decoder.texts([82, 5], [80, 81]) == ["\u201c", "a"]
    assert decoder.texts([82], [80, 1, 2, 3, 4, 81]) == [""], "only the last four tokens are context"
    assert decoder.texts([82], []) == [""]
