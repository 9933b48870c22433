"""`EngineArgs`: every option of vLLM's `EngineArgs`, at vLLM's module path.

Its fields are `arg_list.ENGINE_ARGS`: a base dataclass is generated from that list (each field
at vLLM's default), and `EngineArgs` redeclares the options ferrollm implements with their types
and ferrollm's defaults. Redeclared fields keep the base's order, so the field order is vLLM's.

Constructing one refuses, at once, any option ferrollm does not implement that is set to
anything but vLLM's default (`UnsupportedOptionError`, a ValueError and a NotImplementedError);
`validate` checks the values of the options that work. An unknown keyword is a TypeError, as in
vLLM (`check_known_names` adds the closest known name).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any

import torch

from ferrollm.config.compilation import CompilationConfig
from ferrollm.engine.arg_list import BY_NAME, ENGINE_ARGS, VLLM_VERSION, EngineArg, is_default
from ferrollm.exceptions import ConfigError, UnsupportedOptionError

# The step channel serves up to 112 readers; no machine has that many accelerators.
MAX_TP_SIZE = 64
TOKENIZER_MODES = ("auto", "slow")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _field(arg: EngineArg) -> Any:
    if isinstance(arg.default, (dict, list, set)):
        return field(default_factory=lambda d=arg.default: copy.copy(d))
    return field(default=arg.default)


# Every option at vLLM's default; `EngineArgs` below types and documents the ones that work.
_VllmEngineArgs = make_dataclass("_VllmEngineArgs", [(a.name, Any, _field(a)) for a in ENGINE_ARGS])


@dataclass
class EngineArgs(_VllmEngineArgs):  # type: ignore[valid-type,misc]
    """The engine's options: vLLM 0.32's `EngineArgs` names and defaults.

    Every vLLM name is a field. The ones below work (see `LLM` for their meaning); any other is
    accepted at vLLM's default and refused otherwise (`ferrollm.engine.arg_list` says why).
    Defaults that differ from vLLM's: `seed` None (vLLM 0: leave torch's generator alone),
    `gpu_memory_utilization` 0.9 (vLLM 0.92), `mm_processor_cache_gb` None (the environment's
    `FERROLLM_MM_INPUT_CACHE_GIB` / `VLLM_MM_INPUT_CACHE_GIB`, else 4). None for `max_num_seqs`, `block_size` and
    `enable_prefix_caching` becomes 256, 16 and True.

    Raises:
        UnsupportedOptionError: an option ferrollm does not implement, not at its default.
    """

    model: str = "Qwen/Qwen3-0.6B"
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str | torch.dtype = "auto"
    seed: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    hf_overrides: Any = None
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    load_format: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    compilation_config: CompilationConfig | dict[str, Any] | int | None = None
    # Shorthands for the `compilation_config` fields of the same names, as in vLLM.
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    quantization: str | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    logits_processors: list[Any] | None = None
    # Scheduling and KV cache (vLLM's CacheConfig / SchedulerConfig).
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    enable_chunked_prefill: bool | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    async_scheduling: bool | None = None
    language_model_only: bool = False
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    # None: FERROLLM_MM_INPUT_CACHE_GIB or VLLM_MM_INPUT_CACHE_GIB, else vLLM's 4.
    mm_processor_cache_gb: float | None = None

    def __post_init__(self) -> None:
        for arg in ENGINE_ARGS:
            if arg.works is None and not is_default(arg, getattr(self, arg.name)):
                raise UnsupportedOptionError(refusal(arg, getattr(self, arg.name)))
        self.max_num_seqs = 256 if self.max_num_seqs is None else self.max_num_seqs
        self.block_size = 16 if self.block_size is None else self.block_size
        self.enable_prefix_caching = True if self.enable_prefix_caching is None else self.enable_prefix_caching
        # The classes `logits_processors` names, imported by `validate` (not an option).
        self.logits_processor_classes: list[Any] = []

    def validate(self) -> None:
        """Checks the values of the options ferrollm implements.

        Raises:
            ConfigError: a value out of range, naming the option, the bound and the value.
        """
        self.compilation_config = _with_capture_shorthands(CompilationConfig.from_value(self.compilation_config),
                                                           self.cudagraph_capture_sizes,
                                                           self.max_cudagraph_capture_size)
        if not isinstance(self.tensor_parallel_size, int) or not 1 <= self.tensor_parallel_size <= MAX_TP_SIZE:
            raise ConfigError(f"`tensor_parallel_size` must be an int >= 1 and <= {MAX_TP_SIZE}. Given: {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend not in (None, "mp", "external_launcher"):
            raise ConfigError(
                "`distributed_executor_backend` must be 'mp', 'external_launcher' or None (ferrollm spawns "
                "tensor-parallel ranks on this machine, or joins ranks torchrun started; Ray is not "
                f"supported). Given: {self.distributed_executor_backend!r}")
        from ferrollm.model_executor.loader import LOAD_FORMATS

        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"`load_format` must be one of {list(LOAD_FORMATS)}. Given: {self.load_format!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"`gpu_memory_utilization` must be in (0, 1]. Given: {self.gpu_memory_utilization}")
        if self.block_size < 1:
            raise ConfigError(f"`block_size` must be >= 1. Given: {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"`max_num_seqs` must be >= 1. Given: {self.max_num_seqs}")
        self._validate_logprobs()
        self._validate_scheduling()

    def _validate_scheduling(self) -> None:
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("`num_gpu_blocks_override` must be >= 2 (one block is the reserved null block). "
                              f"Given: {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ConfigError(f"`kv_cache_memory_bytes` must be >= 1. Given: {self.kv_cache_memory_bytes}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"`kv_cache_dtype` must be one of {list(KV_CACHE_DTYPES)}. Given: {self.kv_cache_dtype!r}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(f"`long_prefill_token_threshold` must be >= 0. Given: {self.long_prefill_token_threshold}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"`scheduling_policy` must be 'fcfs' or 'priority'. Given: {self.scheduling_policy!r}")

    def _validate_logprobs(self) -> None:
        from ferrollm.model_executor.sampler import LOGPROBS_MODES
        from ferrollm.worker.logits_processors import load_logits_processor_classes

        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ConfigError(f"`max_logprobs` must be an int >= -1 (-1: no limit). Given: {self.max_logprobs!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ConfigError(f"`logprobs_mode` must be one of {list(LOGPROBS_MODES)}. Given: {self.logprobs_mode!r}")
        # Imports user modules named by string: a bad name fails before the weights load.
        self.logits_processor_classes = load_logits_processor_classes(self.logits_processors)


def _with_capture_shorthands(config: CompilationConfig, sizes: list[int] | None,
                             max_size: int | None) -> CompilationConfig:
    """Folds `cudagraph_capture_sizes` / `max_cudagraph_capture_size` into the compilation
    config (validated there); naming one in both places is refused, as in vLLM."""
    changes: dict[str, Any] = {}
    for name, value in (("cudagraph_capture_sizes", sizes), ("max_cudagraph_capture_size", max_size)):
        if value is None:
            continue
        if getattr(config, name) is not None:
            raise ConfigError(f"`{name}` and `compilation_config.{name}` are mutually exclusive: give one. "
                              f"Given: {value!r} and {getattr(config, name)!r}")
        changes[name] = value
    return dataclasses.replace(config, **changes) if changes else config


def refusal(arg: EngineArg, value: Any) -> str:
    """The message of a refused option: its name, the value given, why, and its default."""
    default = "None or {}" if arg.default == "<default config>" else repr(arg.default)
    return (f"`{arg.name}={value!r}` is refused: {arg.refused} ({arg.group}; ferrollm implements it only at its default). "
            f"Leave it at vLLM's default ({default}).")


def check_known_names(kwargs: dict[str, Any], caller: str = "LLM") -> None:
    """Raises TypeError, as vLLM's `EngineArgs` does, for a keyword that is no vLLM option,
    naming the closest one."""
    known = {f.name for f in fields(EngineArgs)}
    for name in kwargs:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}: it is not an option "
                            f"of vLLM {VLLM_VERSION}'s EngineArgs{hint}")


__all__ = ["BY_NAME", "EngineArgs", "MAX_TP_SIZE", "check_known_names", "refusal"]
