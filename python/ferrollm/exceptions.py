"""ferrollm's exception hierarchy.

Every error the engine raises is a :class:`FerroLLMError`. Errors caused by a bad request or a
bad option also subclass :class:`ValueError`, so code written for vLLM that catches
``ValueError`` keeps working. The Rust core maps each of its error kinds to one class here
(``rust/bindings/src/errors.rs``), by name.
"""

from __future__ import annotations

__all__ = [
    "FerroLLMError",
    "VLLMValidationError",
    "InvalidRequestError",
    "PromptTooLongError",
    "DuplicateRequestError",
    "ConfigError",
    "UnsupportedOptionError",
    "KVCacheTooSmallError",
    "UnsupportedModelError",
    "CheckpointError",
    "TokenizerError",
    "StepMismatchError",
    "EngineError",
    "EngineClosedError",
    "EngineDeadError",
    "WorkerError",
    "StepChannelError",
    "KernelError",
]


class FerroLLMError(Exception):
    """Base class of every ferrollm error."""


class VLLMValidationError(FerroLLMError, ValueError):
    """vLLM's name for a request that failed validation (`vllm.exceptions.VLLMValidationError`),
    so ``except vllm.exceptions.VLLMValidationError`` catches ferrollm's refusals; every
    `InvalidRequestError` is one. A ValueError, as ferrollm's request errors always were.

    Args:
        message: what is wrong.
        parameter: the parameter that failed, when known (vLLM's keyword).
        value: the value given, when known (vLLM's keyword).
    """

    def __init__(self, message: str = "", *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class InvalidRequestError(VLLMValidationError):
    """A request parameter is out of range; the message names it, the bound and the value."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not leave room for one output token within ``max_model_len``."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already used by an unfinished request."""


class ConfigError(FerroLLMError, ValueError):
    """An engine option is invalid; the message names it, the bound and the value."""


class UnsupportedOptionError(ConfigError, NotImplementedError):
    """An engine option of vLLM's that ferrollm does not implement was set to a value other than
    vLLM's default; the message names the option, the value and why. Both a ValueError and a
    NotImplementedError, so either ``except`` catches it."""


class KVCacheTooSmallError(ConfigError):
    """The KV cache cannot hold one ``max_model_len`` sequence; the message gives the largest
    length that fits and the options that help."""


class UnsupportedModelError(ConfigError):
    """The checkpoint's architecture (or one of its options, e.g. a RoPE type) is not implemented;
    the message lists what is supported and how ``hf_overrides`` can name another architecture."""


class CheckpointError(FerroLLMError, ValueError):
    """The checkpoint's files do not match its config: a tensor is missing, unexpected or has
    the wrong shape; the message names the tensor."""


class TokenizerError(FerroLLMError, ValueError):
    """The tokenizer files could not be read, or text could not be encoded."""


class StepMismatchError(FerroLLMError, RuntimeError):
    """The sampled tokens handed to ``update`` do not match the scheduled step."""


class EngineError(FerroLLMError, RuntimeError):
    """The model runner failed while executing a step."""


class EngineClosedError(EngineError):
    """The engine was shut down."""


class EngineDeadError(EngineError):
    """The engine can no longer run steps (a tensor-parallel rank failed); build a new `LLM`."""


class WorkerError(EngineDeadError):
    """A tensor-parallel worker rank raised or died; the message holds that rank's traceback
    (or its exit code)."""


class StepChannelError(EngineError):
    """The shared-memory channel that carries steps to the worker ranks failed, timed out or was
    aborted because a rank died."""


class KernelError(FerroLLMError, ValueError):
    """A CPU kernel (``rust/kernels``) refused its arguments: a buffer whose size does not match
    its shape, or a shape out of the kernel's range. Nothing was written."""
