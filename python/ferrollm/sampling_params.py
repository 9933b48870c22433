"""`SamplingParams`: what a user asks of one generation, with vLLM's fields, defaults and bounds.

The Rust core acts on the stop conditions, lengths and the per-request sampler values
(:meth:`SamplingParams.to_core`); the Python runner reads the rest (``logit_bias``,
``allowed_token_ids``, ``n``, ``output_kind``) straight from this object.
"""

from __future__ import annotations

import copy
import enum
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any, cast

from ferrollm._core import SamplingOptions
from ferrollm.exceptions import InvalidRequestError

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "SamplingType"]

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy; vLLM uses the same threshold.
_SAMPLING_EPS = 1e-5
# Smaller positive temperatures overflow the softmax; vLLM raises them to this value.
_MIN_TEMPERATURE = 1e-2
# The core stores `logprobs` as an unsigned count, so "all of the vocabulary" (-1) crosses the
# boundary as the largest count; the runner caps it at the vocabulary size.
_ALL_LOGPROBS_CORE = 2**32 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class SamplingType(enum.IntEnum):
    """How the sampler picks a request's tokens."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a streamed request carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # nothing until the request finishes


def _invalid(name: str, bound: str, value: Any) -> InvalidRequestError:
    """The one message shape for a bad field: "`name` must be bound. Given: value"."""
    return InvalidRequestError(f"`{name}` must be {bound}. Given: {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_range(name: str, value: Any, lo: float, hi: float, bound: str) -> None:
    """Raises unless `value` is a finite number in [lo, hi]."""
    if not _is_number(value) or not math.isfinite(value) or not lo <= value <= hi:
        raise _invalid(name, bound, value)


def _check_finite(name: str, value: Any, bound: str) -> None:
    """Raises for NaN and infinities with vLLM's wording ("temperature must be a finite number")."""
    if _is_number(value) and not math.isfinite(value):
        raise _invalid(name, f"{bound} ({name} must be a finite number)", value)


def _check_token_ids(name: str, ids: Any) -> list[int]:
    """Returns `ids` as a list, raising unless it is a sequence of non-negative ints."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise _invalid(name, "a list of token ids (non-negative ints)", ids)
    ids = list(ids)
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise _invalid(name, "a list of token ids (non-negative ints)", ids)
    return ids


def _normalize_stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise _invalid("stop", "a string or a list of strings", stop)
    return list(stop)


def _normalize_logit_bias(bias: Any) -> dict[int, float] | None:
    """Keys become int token ids (JSON gives strings, as the OpenAI API sends them)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise _invalid("logit_bias", "a dict of token id to bias", bias)
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key) if not isinstance(key, (bool, float)) else None
        except (TypeError, ValueError):
            token = None
        if token is None or token < 0:
            raise _invalid("logit_bias", "keyed by token ids (non-negative ints)", key)
        if not _is_number(value) or not math.isfinite(value):
            raise _invalid(f"logit_bias[{token}]", "a finite number", value)
        out[token] = float(value)
    return out


@dataclass(eq=True, repr=False)
class SamplingParams:
    """Sampling parameters for text generation, as in vLLM's offline API.

    The field list, defaults and bounds follow vLLM's `SamplingParams`; an out-of-range value
    raises :class:`ferrollm.exceptions.InvalidRequestError` (a `ValueError`) naming the field,
    the bound and the value given.

    Args:
        n: Number of outputs to return for the prompt (>= 1; 1 when greedy).
        presence_penalty: Subtracted once from the logit of every token already generated,
            in [-2, 2].
        frequency_penalty: Subtracted from a token's logit once per time it was generated,
            in [-2, 2].
        repetition_penalty: Divides positive (multiplies negative) logits of tokens seen in the
            prompt or output, in (0, 2]; 1 disables it.
        temperature: Softmax temperature, >= 0; below 1e-5 means greedy sampling.
        top_p: Keep the smallest set of likeliest tokens whose probability reaches `top_p`,
            in (0, 1].
        top_k: Keep the `top_k` likeliest tokens; 0 (or -1) keeps all.
        min_p: Drop tokens less likely than `min_p` times the likeliest one, in [0, 1].
        seed: Seed for this request's own random generator (-1 means none).
        stop: String(s) that end the generation; they are left out of the text.
        stop_token_ids: Token ids that end the generation.
        ignore_eos: Keep generating after the EOS token.
        max_tokens: Most tokens to generate (>= 1); None means up to `max_model_len`.
        min_tokens: Fewest tokens to generate before EOS or stop tokens may end it.
        logprobs: Number of top log probabilities to return per output token (plus the
            sampled token's); -1 returns the whole vocabulary.
        prompt_logprobs: Number of log probabilities to return per prompt token; -1 for all.
        detokenize: Turn output token ids into text.
        skip_special_tokens: Leave special tokens out of the text.
        spaces_between_special_tokens: Put spaces between special tokens in the text.
        include_stop_str_in_output: Keep the stop string at the end of the text.
        output_kind: What each streamed output carries (`RequestOutputKind`).
        logit_bias: Token id -> value added to that token's logit before sampling.
        allowed_token_ids: When given, only these token ids may be sampled.
        best_of: Accepted for older scripts only when None or equal to `n`.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    best_of: int | None = field(default=None)

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.is_greedy:
            self._normalize_greedy()

    # -- construction ---------------------------------------------------------------------

    def _normalize(self) -> None:
        """vLLM's accepted spellings become one canonical form before validation."""
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        # vLLM now documents 0 as "disabled" and quietly accepts the older -1.
        if _is_int(self.top_k) and self.top_k == -1:
            self.top_k = 0
        self.stop = _normalize_stop(self.stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.stop_token_ids = list(dict.fromkeys(_check_token_ids("stop_token_ids", ids)))
        # `logprobs=True` means "the sampled token's", as in vLLM.
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids)
        if _is_number(self.temperature) and 0 < self.temperature < _MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and would overflow the softmax; using %s.",
                self.temperature, _MIN_TEMPERATURE, _MIN_TEMPERATURE,
            )
            self.temperature = _MIN_TEMPERATURE

    def _verify_args(self) -> None:
        self._verify_counts()
        self._verify_sampler_values()
        self._verify_lengths()
        self._verify_logprobs()
        self._verify_stops()
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise _invalid("allowed_token_ids", "non-empty when given", self.allowed_token_ids)
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _invalid("output_kind", "a RequestOutputKind", self.output_kind)

    def _verify_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _invalid("n", ">= 1", self.n)
        if self.best_of is not None and self.best_of != self.n:
            raise _invalid("best_of", f"None or equal to n ({self.n})", self.best_of)
        if self.seed is not None and not (_is_int(self.seed) and
                                          _INT64_MIN <= self.seed <= _INT64_MAX):
            raise _invalid("seed", "None or a 64-bit int", self.seed)

    def _verify_sampler_values(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0, "in [-2, 2]")
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "in [-2, 2]")
        # vLLM >= 0.8.4 has no upper bound; the core checks the same rule.
        _check_finite("repetition_penalty", self.repetition_penalty, "a finite number > 0")
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "a finite number > 0")
        if self.repetition_penalty == 0.0:
            raise _invalid("repetition_penalty", "a finite number > 0", self.repetition_penalty)
        _check_finite("temperature", self.temperature, "a finite number >= 0")
        _check_range("temperature", self.temperature, 0.0, math.inf, "a finite number >= 0")
        _check_range("top_p", self.top_p, 0.0, 1.0, "in (0, 1]")
        if self.top_p == 0.0:
            raise _invalid("top_p", "in (0, 1]", self.top_p)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _invalid("top_k", "-1 (disable), 0 (disable) or >= 1", self.top_k)
        _check_range("min_p", self.min_p, 0.0, 1.0, "in [0, 1]")

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _invalid("max_tokens", ">= 1 or None", self.max_tokens)
        # vLLM's wording in parentheses: scripts match on it.
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _invalid("min_tokens", ">= 0 (min_tokens must be greater than or equal to 0)", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _invalid("min_tokens", f"<= max_tokens ({self.max_tokens}) (min_tokens must be less than or "
                           "equal to max_tokens)", self.min_tokens)

    def _verify_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):
                raise _invalid(name, ">= 0, -1 (whole vocabulary) or None", value)

    def _verify_stops(self) -> None:
        if any(not s for s in self._stop_list):
            raise _invalid("stop", "a list of non-empty strings", self.stop)
        if self.stop and not self.detokenize:
            raise _invalid("stop", "empty when detokenize=False (stop strings need text)",
                           self.stop)

    def _normalize_greedy(self) -> None:
        """Greedy decoding ignores the filters; vLLM resets them so reprs and caches agree."""
        if self.n > 1:
            raise _invalid("n", "1 when using greedy sampling (temperature=0)", self.n)
        self.top_p = 1.0
        self.top_k = 0
        self.min_p = 0.0

    # -- queries --------------------------------------------------------------------------

    @property
    def sampling_type(self) -> SamplingType:
        """GREEDY below temperature 1e-5, else RANDOM_SEED when seeded, else RANDOM."""
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def _stop_list(self) -> list[str]:
        """`stop` as the list construction made it (a field may not narrow its own type)."""
        return cast("list[str]", self.stop)

    @property
    def _stop_id_list(self) -> list[int]:
        """`stop_token_ids` as the list construction made it."""
        return cast("list[int]", self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        """Whether the sampler takes the argmax for this request."""
        return self.temperature < _SAMPLING_EPS

    def verify_token_ids(self, vocab_size: int) -> None:
        """Checks every token id the request names against the model's vocabulary.

        Args:
            vocab_size: Width of the model's logits (its vocabulary, padding included).

        Raises:
            InvalidRequestError: An id in `stop_token_ids`, `logit_bias` or
                `allowed_token_ids` is >= `vocab_size`.
        """
        named = {
            "stop_token_ids": self._stop_id_list,
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
        }
        for name, ids in named.items():
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise _invalid(name, f"token ids < vocab_size ({vocab_size})", bad)

    def clone(self) -> SamplingParams:
        """A deep copy, so the engine can normalise it without touching the caller's object.

        Returns:
            An equal, independent `SamplingParams`.
        """
        return copy.deepcopy(self)

    def to_core(self) -> SamplingOptions:
        """The fields the Rust core acts on (stops, lengths, the sampler's per-request values).

        Returns:
            A `ferrollm.SamplingOptions` for `EngineCore.add_requests`.
        """
        return SamplingOptions(
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            stop=list(self._stop_list),
            stop_token_ids=list(self._stop_id_list),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            detokenize=self.detokenize,
            logprobs=_logprobs_to_core(self.logprobs),
            prompt_logprobs=_logprobs_to_core(self.prompt_logprobs),
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=self.top_k,
            min_p=float(self.min_p),
            seed=self.seed,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
        )

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"SamplingParams({parts})"


def _logprobs_to_core(value: int | None) -> int | None:
    return _ALL_LOGPROBS_CORE if value == -1 else value


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters, for `LLM.beam_search` (issue #27 part B builds the search;
    this is the class scripts import).

    Args:
        beam_width: beams kept at each step (>= 1).
        max_tokens: tokens generated per beam (>= 1).
        ignore_eos: keep extending beams past EOS.
        temperature: sampling temperature of the candidates (0: greedy scores).
        length_penalty: the exponent of the length normalizing the beams' scores.
        include_stop_str_in_output: keep the stop string in the text.
        structured_outputs: vLLM's structured outputs (must be None here).
        skip_special_tokens: leave special tokens out of the text.
        watermarking: vLLM's watermarking switch (must be None here).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    structured_outputs: Any = None
    skip_special_tokens: bool = True
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise _invalid("beam_width", ">= 1", self.beam_width)
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _invalid("max_tokens", ">= 1", self.max_tokens)
        _check_range("temperature", self.temperature, 0.0, math.inf, "a finite number >= 0")
        _check_range("length_penalty", self.length_penalty, -math.inf, math.inf, "a finite number")
        for name in ("structured_outputs", "watermarking"):
            if getattr(self, name) is not None:
                raise _invalid(name, "None (not supported by ferrollm)", getattr(self, name))
