"""PoolingParams and the resolution of the runner and the pooler: vLLM's fields and precedence,
with messages that name the field, the bound and the value given."""

from __future__ import annotations

import json
import logging

import pytest
import transformers

from ferrollm import PoolerConfig, PoolingParams
from ferrollm.config.pooler_config import (
    PoolingModelConfig,
    read_st_encoder_config,
    read_st_pooling,
    resolve_pooler,
    resolve_runner,
)
from ferrollm.exceptions import ConfigError, InvalidRequestError


def test_defaults_equal_vllms():
    p = PoolingParams()
    assert (p.truncate_prompt_tokens, p.dimensions, p.normalize, p.task) == (None, None, None, None)


@pytest.mark.parametrize(
    ("kwargs", "field", "bound", "given"),
    [
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "-1 (max_model_len), >= 1 or None", "-2"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1 (max_model_len), >= 1 or None", "0"),
        ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens", ">= 1 or None", "2.5"),
        ({"dimensions": 0}, "dimensions", ">= 1 or None", "0"),
        ({"dimensions": True}, "dimensions", ">= 1 or None", "True"),
        ({"normalize": "yes"}, "normalize", "True, False or None", "'yes'"),
        ({"normalize": True, "use_activation": False}, "use_activation", "equal to normalize (True)", "False"),
        ({"task": "generate"}, "task", "one of ['embed'", "'generate'"),
    ],
)
def test_invalid_fields_name_field_bound_and_value(kwargs, field, bound, given):
    with pytest.raises(InvalidRequestError) as info:
        PoolingParams(**kwargs)
    message = str(info.value)
    assert f"`{field}`" in message and bound in message and f"Given: {given}" in message
    assert isinstance(info.value, ValueError)


def model(**kw) -> PoolingModelConfig:
    return PoolingModelConfig(**{"pooling_type": "LAST", "normalize": True, "hidden_size": 64,
                                 "model_name": "tiny", **kw})


def test_verify_sets_the_task_and_takes_the_models_normalize():
    p = PoolingParams()
    p.verify("embed", model(normalize=False))
    assert (p.task, p.normalize) == ("embed", False)
    q = PoolingParams(use_activation=False)  # vLLM's newer name for it
    q.verify("embed", model())
    assert q.normalize is False
    r = PoolingParams(normalize=True)
    r.verify("token_embed", model(normalize=False))
    assert (r.task, r.normalize) == ("token_embed", True)


def test_verify_rejects_other_tasks():
    with pytest.raises(InvalidRequestError, match="`task` must be 'embed' for this call.*Given: 'token_embed'"):
        PoolingParams(task="token_embed").verify("embed", model())
    with pytest.raises(InvalidRequestError, match="the tasks ferrollm runs.*Given: 'classify'"):
        PoolingParams(task="classify").verify("classify", model())


def test_dimensions_need_a_matryoshka_model_and_fit_it():
    with pytest.raises(InvalidRequestError, match="Matryoshka.*'tiny'.*is_matryoshka.*Given: 8"):
        PoolingParams(dimensions=8).verify("embed", model())
    PoolingParams(dimensions=8).verify("embed", model(is_matryoshka=True))
    with pytest.raises(InvalidRequestError, match="`dimensions` must be <= the model's embedding size \\(64\\). Given: 65"):
        PoolingParams(dimensions=65).verify("embed", model(is_matryoshka=True))
    limited = model(is_matryoshka=True, matryoshka_dimensions=(16, 32))
    PoolingParams(dimensions=32).verify("embed", limited)
    with pytest.raises(InvalidRequestError, match="matryoshka_dimensions \\[16, 32\\]. Given: 8"):
        PoolingParams(dimensions=8).verify("embed", limited)


def test_clone_is_independent():
    p = PoolingParams(dimensions=4)
    q = p.clone()
    q.verify("embed", model(is_matryoshka=True))
    assert p.task is None and q.task == "embed" and p != q


def write_st(folder, mode: str | None, normalize: bool, extra_modes: tuple[str, ...] = ()):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (folder / "1_Pooling").mkdir()
        flags = {f"pooling_mode_{m}": True for m in (mode, *extra_modes)}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **flags}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize(
    ("mode", "normalize", "expected"),
    [("mean_tokens", True, ("MEAN", True)), ("cls_token", False, ("CLS", False)),
     ("lasttoken", True, ("LAST", True)), (None, True, (None, True))],
)
def test_sentence_transformers_pooling_is_read(tmp_path, mode, normalize, expected):
    write_st(tmp_path, mode, normalize)
    assert read_st_pooling(tmp_path) == expected


def test_unsupported_or_absent_sentence_transformers_pooling(tmp_path, caplog):
    assert read_st_pooling(tmp_path) == (None, None)
    write_st(tmp_path, "max_tokens", True)
    with caplog.at_level(logging.WARNING):
        assert read_st_pooling(tmp_path) == (None, True)
    assert "pooling_mode_max_tokens" in caplog.text


def test_sentence_bert_config_is_read(tmp_path):
    assert read_st_encoder_config(tmp_path) == {}
    (tmp_path / "sentence_bert_config.json").write_text('{"max_seq_length": 256, "do_lower_case": true}')
    assert read_st_encoder_config(tmp_path) == {"max_seq_length": 256, "do_lower_case": True}


@pytest.mark.parametrize(
    ("runner", "convert", "pooling_only", "st", "expected"),
    [
        ("auto", "auto", False, False, ("generate", "none")),
        ("auto", "auto", True, False, ("pooling", "none")),
        ("pooling", "auto", False, False, ("pooling", "embed")),
        ("auto", "embed", False, False, ("pooling", "embed")),
        ("auto", "auto", False, True, ("pooling", "embed")),  # an ST checkpoint of a *ForCausalLM
        ("generate", "none", False, True, ("generate", "none")),
    ],
)
def test_runner_resolution(runner, convert, pooling_only, st, expected):
    assert resolve_runner(runner, convert, "XForCausalLM", pooling_only, st) == expected


@pytest.mark.parametrize(
    ("runner", "convert", "pooling_only", "match"),
    [
        ("generate", "auto", True, "`runner` must be 'pooling' \\(or 'auto'\\) for XModel.*Given: 'generate'"),
        ("generate", "embed", False, "`convert='embed'` needs `runner` 'pooling' or 'auto'"),
        ("draft", "auto", False, "`runner` must be one of \\['auto', 'generate', 'pooling'\\]. Given: 'draft'"),
        ("auto", "classify", False, "`convert` must be one of .*Given: 'classify'"),
    ],
)
def test_impossible_runner_choices_are_errors(runner, convert, pooling_only, match):
    with pytest.raises(ConfigError, match=match):
        resolve_runner(runner, convert, "XModel", pooling_only, False)


def test_pooler_precedence_user_then_sentence_transformers_then_model():
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, matryoshka_dimensions=[16])
    assert resolve_pooler(PoolerConfig(), (None, None), "CLS", config, "m").pooling_type == "CLS"
    from_st = resolve_pooler(PoolerConfig(), ("MEAN", False), "CLS", config, "m")
    assert (from_st.pooling_type, from_st.normalize) == ("MEAN", False)
    user = resolve_pooler(PoolerConfig(pooling_type="last", normalize=True), ("MEAN", False), "CLS", config, "m")
    assert (user.pooling_type, user.normalize, user.hidden_size) == ("LAST", True, 64)
    assert (user.is_matryoshka, user.matryoshka_dimensions) == (True, (16,))


def test_pooler_config_accepts_dicts_and_checks_values():
    assert PoolerConfig.coerce({"seq_pooling_type": "MEAN"}).pooling_type == "MEAN"
    with pytest.raises(ConfigError, match="`pooler_config.pooling_type` must be one of .*Given: 'MAX'"):
        PoolerConfig(pooling_type="MAX")
    with pytest.raises(ConfigError, match="`pooler_config` keys must be among .*Given: \\['softmax'\\]"):
        PoolerConfig.coerce({"softmax": True})
