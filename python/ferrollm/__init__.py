"""ferrollm: a vLLM-compatible LLM inference engine with a Rust core.

The engine core (scheduler, paged KV cache with prefix caching, tokenizer pipeline) lives in the
native module :mod:`ferrollm._core`; this package is its Python front.
"""

from __future__ import annotations

from ferrollm import exceptions, inputs, logprobs
from ferrollm._core import (
    EngineCore,
    EngineCoreOutput,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
    Tokenizer,
    __version__,
)
from ferrollm.config.pooler_config import PoolerConfig
from ferrollm.inputs import PromptType, TextPrompt, TokensPrompt
from ferrollm.logger import configure_logging
from ferrollm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ferrollm.pooling_params import PoolingParams
from ferrollm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

configure_logging()

__all__ = [
    "LLM",
    "AsyncLLM",
    "BeamSearchParams",
    "EngineArgs",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineCore",
    "EngineCoreOutput",
    "Logprob",
    "NewRequestData",
    "PoolerConfig",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingOptions",
    "SamplingParams",
    "SchedulerOutput",
    "TextPrompt",
    "TokensPrompt",
    "ScoringOutput",
    "ScoringRequestOutput",
    "Tokenizer",
    "exceptions",
    "inputs",
    "logprobs",
    "__version__",
]


def __getattr__(name: str):
    # `LLM` pulls in torch and transformers; load it on first use so the core stays light.
    if name == "LLM":
        from ferrollm.entrypoints.llm import LLM

        return LLM
    if name == "EngineArgs":  # vLLM exports it at the top level too; it imports torch
        from ferrollm.engine.arg_utils import EngineArgs

        return EngineArgs
    if name == "AsyncLLM":
        from ferrollm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'ferrollm' has no attribute {name!r}")
