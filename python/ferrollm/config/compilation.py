"""`CompilationConfig` and `CompilationLevel`, under vLLM's names, and the CUDA-graph batch sizes
they decide.

`LLM(compilation_config=...)` takes what vLLM's takes: a `CompilationConfig`, a dict of its
fields, or an int level. The level says how the model is compiled on a GPU (worker/compiler.py:
eager, Dynamo as is, Dynamo once, or PIECEWISE: the graph cut at attention and the pieces compiled
with ``backend``); on the CPU the model always runs eagerly. The config also decides which decode
batch sizes get a captured CUDA graph: a decode step of `n` requests is padded to the smallest
captured size `>= n` (:meth:`CompilationConfig.pad_for_cudagraph`) and replayed, and a larger
one runs eagerly.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ferrollm.exceptions import ConfigError

__all__ = ["CompilationConfig", "CompilationLevel", "default_capture_sizes"]


class CompilationLevel(enum.IntEnum):
    """vLLM's compilation levels (vLLM >= 0.11 calls the field `mode`; both are accepted)."""

    NO_COMPILATION = 0
    DYNAMO_AS_IS = 1
    DYNAMO_ONCE = 2
    PIECEWISE = 3


# vLLM fields that tune its own compiler passes and caches, which ferrollm does not have: accepted
# in a dict so vLLM scripts keep working, and ignored.
IGNORED_VLLM_FIELDS = frozenset({
    "custom_ops", "splitting_ops", "compile_sizes", "use_inductor", "inductor_compile_config",
    "inductor_passes", "pass_config", "debug_dump_path", "cache_dir", "compile_cache_save_format",
    "cudagraph_num_of_warmups", "cudagraph_copy_inputs", "full_cuda_graph", "use_inductor_graph_partition",
    "compile_mm_encoder",
})
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# Past this, vLLM stops generating default capture sizes (each graph costs start-up time and
# memory for little gain).
DEFAULT_MAX_CAPTURE_SIZE = 512


@dataclass
class CompilationConfig:
    """How the model is compiled and which decode batch sizes are captured as CUDA graphs.

    Args:
        level: a :class:`CompilationLevel` (0-3) for a GPU model; default ``NO_COMPILATION``
            (vLLM's default is ``PIECEWISE``; ferrollm keeps start-up free of compile time unless
            asked). The CPU always runs eagerly.
        mode: vLLM >= 0.11's name for ``level``.
        backend: the ``torch.compile`` backend of levels 1-3 (and of PIECEWISE's pieces);
            ``""`` means ``"inductor"``, as in vLLM.
        cudagraph_capture_sizes: batch sizes to capture; default: vLLM's list, 1, 2, 4, then
            every multiple of 8 below 256 and of 16 from 256, up to ``max_cudagraph_capture_size``.
        max_cudagraph_capture_size: the largest default size; default ``min(2 * max_num_seqs, 512)``.
        cudagraph_mode: vLLM's ``CUDAGraphMode`` name; ``"NONE"`` captures nothing, any other
            mode captures ferrollm's full decode graphs.
        use_cudagraph: ``False`` captures nothing (vLLM's older switch).

    Raises:
        ConfigError: for a value out of range; the message names the field, bound and value.
    """

    level: int | None = None
    mode: int | None = None
    backend: str = ""
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    cudagraph_mode: str | None = None
    use_cudagraph: bool = True
    # Set by `init_capture_sizes`: the sorted sizes this engine captures.
    _capture_sizes: list[int] = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("level", "mode"):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, _level(name, value))
        if self.level is not None and self.mode is not None and self.level != self.mode:
            raise ConfigError(f"`level` and `mode` name the same setting and must agree. "
                              f"Given: level={int(self.level)}, mode={int(self.mode)}")
        self.level = self.mode = self.level if self.level is not None else self.mode
        if not isinstance(self.backend, str):
            raise ConfigError(f"`backend` must be a torch.compile backend name. Given: {self.backend!r}")
        if self.cudagraph_capture_sizes is not None:
            self.cudagraph_capture_sizes = _sizes(self.cudagraph_capture_sizes)
        if self.max_cudagraph_capture_size is not None:
            _check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 0)
        if self.cudagraph_mode is not None:
            mode = getattr(self.cudagraph_mode, "name", self.cudagraph_mode)
            if not isinstance(mode, str) or mode.upper() not in CUDAGRAPH_MODES:
                raise ConfigError(f"`cudagraph_mode` must be one of {list(CUDAGRAPH_MODES)}. Given: {self.cudagraph_mode!r}")
            self.cudagraph_mode = mode.upper()

    @classmethod
    def from_value(cls, value: CompilationConfig | Mapping[str, Any] | int | None) -> CompilationConfig:
        """Reads ``LLM(compilation_config=...)`` as vLLM does.

        Args:
            value: a config, a dict of its fields (vLLM's torch.compile-only fields are ignored),
                an int level, or None for the defaults.

        Returns:
            A new config (a given config is returned as is).

        Raises:
            ConfigError: for another type, an unknown key, or a bad value.
        """
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            return cls(level=value)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls) if f.init}
            unknown = sorted(set(value) - known - IGNORED_VLLM_FIELDS)
            if unknown:
                raise ConfigError(f"`compilation_config` has unknown keys {unknown}; known: {sorted(known)}")
            return cls(**{k: v for k, v in value.items() if k in known})
        raise ConfigError("`compilation_config` must be a CompilationConfig, a dict or an int level. "
                          f"Given: {type(value).__name__}")

    @property
    def captures_cudagraphs(self) -> bool:
        """False when the user turned CUDA graphs off in this config."""
        return self.use_cudagraph and self.cudagraph_mode != "NONE"

    def init_capture_sizes(self, max_num_seqs: int, max_num_batched_tokens: int,
                           enforce_eager: bool = False) -> list[int]:
        """Decides the sizes to capture for this engine; :meth:`pad_for_cudagraph` then uses them.

        vLLM's rules, then capped by ``max_num_seqs``: ferrollm captures decode steps (one token
        per request), so only sizes up to the first one that holds ``max_num_seqs`` can be used.

        Args:
            max_num_seqs: requests per step.
            max_num_batched_tokens: tokens per step; larger user sizes are dropped, as vLLM does.
            enforce_eager: capture nothing.

        Returns:
            The sorted sizes (empty when nothing is captured).

        Raises:
            ConfigError: if ``max_cudagraph_capture_size`` disagrees with the largest given size.
        """
        if enforce_eager or not self.captures_cudagraphs:
            self._capture_sizes = []
            return []
        if self.cudagraph_capture_sizes is not None:
            sizes = [s for s in self.cudagraph_capture_sizes if s <= max_num_batched_tokens]
            largest = sizes[-1] if sizes else 0
            if self.max_cudagraph_capture_size is not None and self.max_cudagraph_capture_size != largest:
                raise ConfigError(f"`max_cudagraph_capture_size` must equal the largest usable "
                                  f"`cudagraph_capture_sizes` entry ({largest}). Given: {self.max_cudagraph_capture_size}")
        else:
            largest = self.max_cudagraph_capture_size
            if largest is None:
                largest = min(2 * max_num_seqs, DEFAULT_MAX_CAPTURE_SIZE)
            sizes = default_capture_sizes(min(largest, max_num_batched_tokens))
        holds_all = bisect.bisect_left(sizes, max_num_seqs)
        self._capture_sizes = sizes[: holds_all + 1]
        return list(self._capture_sizes)

    @property
    def capture_sizes(self) -> list[int]:
        """The sizes decided by :meth:`init_capture_sizes` (empty before it runs)."""
        return list(self._capture_sizes)

    def pad_for_cudagraph(self, batch_size: int) -> int | None:
        """The captured size a decode step of ``batch_size`` requests replays.

        Returns:
            The smallest captured size ``>= batch_size``, or None when the step runs eagerly.
        """
        i = bisect.bisect_left(self._capture_sizes, batch_size)
        return self._capture_sizes[i] if i < len(self._capture_sizes) else None


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's default capture sizes up to ``max_size``: 1, 2, 4, multiples of 8 below 256, then of 16."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += range(8, min(max_size + 1, 256), 8)
    sizes += range(256, max_size + 1, 16)
    return sizes


def _level(name: str, value: Any) -> CompilationLevel:
    if isinstance(value, bool) or not isinstance(value, int) or value not in CompilationLevel._value2member_map_:
        raise ConfigError(f"`{name}` must be an int in [0, 3] (CompilationLevel). Given: {value!r}")
    return CompilationLevel(value)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"`{name}` must be an int >= {minimum}. Given: {value!r}")


def _sizes(value: Any) -> list[int]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"`cudagraph_capture_sizes` must be a list of ints. Given: {value!r}")
    sizes = list(value)
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ConfigError(f"`cudagraph_capture_sizes` entries must be ints >= 1. Given: {sizes!r}")
    return sorted(set(sizes))
