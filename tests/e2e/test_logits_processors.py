"""Custom logits processors as vLLM v1 takes them: `LLM(logits_processors=[cls or name])`,
switched per request by `SamplingParams.extra_args`, written against the interface at vLLM's
module paths (the shape of vLLM's example processors)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm.config import VllmConfig
from ferrollm.exceptions import ConfigError
from ferrollm.v1.sample.logits_processor import AdapterLogitsProcessor, BatchUpdate, LogitsProcessor
from ferrollm.v1.sample.logits_processor.builtin import process_dict_updates

PROMPTS = [[1, 17, 42, 99], [1, 5, 6, 7, 8, 9], [1, 250, 31], [1, 100, 101, 102, 103]]


class TargetToken(LogitsProcessor):
    """Keeps only `extra_args["target_token"]` for the requests that name one."""

    @classmethod
    def validate_params(cls, params: SamplingParams):
        target = params.extra_args and params.extra_args.get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token value {target!r} is not int")

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        assert vllm_config.model_config.max_model_len > 0
        self.req_info: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None):
        process_dict_updates(self.req_info, batch_update,
                             lambda params, _, __: params.extra_args and params.extra_args.get("target_token"))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.req_info:
            return logits
        rows = torch.tensor(list(self.req_info), dtype=torch.long)
        cols = torch.tensor(list(self.req_info.values()), dtype=torch.long)
        keep = logits[rows, cols].clone()
        logits[rows] = float("-inf")
        logits[rows, cols] = keep
        return logits


class KeepOne:
    def __init__(self, target: int):
        self.target = target

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        keep = logits[self.target].item()
        logits[:] = float("-inf")
        logits[self.target] = keep
        return logits


class WrappedTargetToken(AdapterLogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams) -> Any:
        target = params.extra_args and params.extra_args.get("target_token")
        return None if target is None else KeepOne(target)


def params_for(i: int, target: int | None) -> SamplingParams:
    extra = None if target is None else {"target_token": target}
    # Different lengths, so requests finish at different steps and indices are re-used.
    return SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True, extra_args=extra)


@pytest.mark.parametrize("spec", [TargetToken, f"{__name__}:WrappedTargetToken", f"{__name__}.TargetToken"],
                         ids=["class", "fqcn-colon", "dotted-name"])
def test_processor_applies_only_to_requests_that_ask(tiny_llama, spec):
    path, _ = tiny_llama
    targets = [128, None, 67, None]
    with LLM(model=str(path), max_num_seqs=2) as plain:
        base = plain.generate([{"prompt_token_ids": p} for p in PROMPTS],
                              [params_for(i, None) for i in range(4)], use_tqdm=False)
    with LLM(model=str(path), max_num_seqs=2, logits_processors=[spec]) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            [params_for(i, t) for i, t in enumerate(targets)], use_tqdm=False)
    for i, (t, out, ref) in enumerate(zip(targets, outs, base)):
        ids = list(out.outputs[0].token_ids)
        if t is None:
            assert ids == list(ref.outputs[0].token_ids)
        else:
            assert ids == [t] * (3 + 2 * i)


def test_validate_params_refuses_a_bad_request(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), logits_processors=[TargetToken]) as llm:
        with pytest.raises(ValueError, match="target_token value 'x' is not int"):
            llm.generate(["hi"], SamplingParams(extra_args={"target_token": "x"}), use_tqdm=False)


def test_bad_processor_names_fail_at_construction(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ConfigError, match="could not load"):
        LLM(model=str(path), logits_processors=["no_such_module:Nope"])
    with pytest.raises(ConfigError, match="subclasses of"):
        LLM(model=str(path), logits_processors=[KeepOne])


def test_pooling_models_refuse_logits_processors(tiny_bert):
    with pytest.raises(ConfigError, match="Pooling models do not support custom logits processors"):
        LLM(model=str(tiny_bert[0]), logits_processors=[TargetToken])
