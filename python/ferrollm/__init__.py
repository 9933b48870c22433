"""ferrollm: a vLLM-compatible LLM inference engine with a Rust core.

The engine core (scheduler, paged KV cache with prefix caching, tokenizer pipeline) lives in the
native module :mod:`ferrollm._core`; this package is its Python front.
"""

from __future__ import annotations

from ferrollm import exceptions
from ferrollm._core import (
    EngineCore,
    EngineCoreOutput,
    NewRequestData,
    SamplingOptions,
    SchedulerOutput,
    Tokenizer,
    __version__,
)

__all__ = [
    "EngineCore",
    "EngineCoreOutput",
    "NewRequestData",
    "SamplingOptions",
    "SchedulerOutput",
    "Tokenizer",
    "exceptions",
    "__version__",
]
