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


def _normalize_bad_words(words: Any) -> list[str]:
    """A list of distinct non-empty strings, in the order given."""
    if words is None:
        return []
    if isinstance(words, str) or not isinstance(words, (list, tuple)) or \
            not all(isinstance(w, str) for w in words):
        raise _invalid("bad_words", "a list of strings", words)
    if any(not w for w in words):
        raise InvalidRequestError(f"bad_words cannot contain an empty string. Got bad_words={list(words)}")
    return list(dict.fromkeys(words))


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
        flat_logprobs: Return logprobs as a `ferrollm.logprobs.FlatLogprobs` (a few flat lists
            read like the list of dicts) instead of a list of dicts.
        bad_words: Words that may not be generated: the last token of each word (as it
            tokenizes alone and after a space) is blocked whenever the tokens before it were
            just generated.
        extra_args: Free-form values for custom logits processors (`LLM(logits_processors=...)`)
            to read; the engine itself ignores them.
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
    flat_logprobs: bool = False
    bad_words: list[str] | None = None
    extra_args: dict[str, Any] | None = None

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
        self.bad_words = _normalize_bad_words(self.bad_words)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise _invalid("extra_args", "a dict or None", self.extra_args)
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
            InvalidRequestError: An id in `stop_token_ids`, `logit_bias`,
                `allowed_token_ids` or the tokenized `bad_words` is >= `vocab_size`.
        """
        named = {
            "stop_token_ids": self._stop_id_list,
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": self.allowed_token_ids or [],
            "bad_words": [i for word in self.bad_words_token_ids or [] for i in word],
        }
        for name, ids in named.items():
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise _invalid(name, f"token ids < vocab_size ({vocab_size})", bad)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """`bad_words` as token id sequences, once `update_from_tokenizer` has run."""
        return getattr(self, "_bad_words_token_ids", None)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenizes `bad_words` as vLLM does: each word with its leading spaces stripped, and
        again after one space where that gives a different first token but as many tokens (the
        same word in the middle of a text).

        Args:
            tokenizer: Anything with `encode(text=..., add_special_tokens=False)`.

        Raises:
            InvalidRequestError: A word tokenizes to nothing.
        """
        if self._bad_word_list and tokenizer is None:
            raise InvalidRequestError("`bad_words` needs the tokenizer, which `skip_tokenizer_init=True` leaves "
                                      f"out; pass token ids in `allowed_token_ids` or `logit_bias` instead. "
                                      f"Given: {self._bad_word_list!r}")
        ids: list[list[int]] = []
        for word in self._bad_word_list:
            bare = tokenizer.encode(text=word.lstrip(), add_special_tokens=False)
            if not bare:
                raise _invalid("bad_words", "words that tokenize to at least one token", word)
            ids.append(list(bare))
            spaced = tokenizer.encode(text=" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                ids.append(list(spaced))
        self._bad_words_token_ids = ids

    @property
    def _bad_word_list(self) -> list[str]:
        return cast("list[str]", self.bad_words)

    def verify_logprobs(self, max_logprobs: int, vocab_size: int) -> None:
        """Checks `logprobs` and `prompt_logprobs` against the engine's `max_logprobs`, with
        vLLM's wording.

        Args:
            max_logprobs: The engine's limit; -1 allows the whole vocabulary.
            vocab_size: The model's vocabulary size (what -1 asks for).

        Raises:
            InvalidRequestError: More logprobs are asked for than `max_logprobs` allows.
        """
        limit = vocab_size if max_logprobs == -1 else max_logprobs
        for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            value = getattr(self, name)
            asked = vocab_size if value == -1 else value
            if asked and asked > limit:
                raise InvalidRequestError(
                    f"Requested {kind} logprobs of {asked}, which is greater than max allowed: {limit} "
                    f"(`{name}` must be <= max_logprobs ({limit}); raise LLM(max_logprobs=...) or pass -1 "
                    f"for no limit. Given: {value})")

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
    """Beam search parameters for `LLM.beam_search`, as in vLLM.

    Args:
        beam_width: Beams kept after each step (>= 1).
        max_tokens: Most tokens to generate (>= 1).
        ignore_eos: Keep extending beams that produce EOS instead of finishing them.
        temperature: Sampling temperature of each step's one-token request (>= 0); the beams'
            scores use the raw logprobs either way.
        length_penalty: A finished beam's score is its cumulative logprob divided by its length
            (prompt included, a final EOS not) to this power.
        include_stop_str_in_output: Accepted for vLLM's signature; beam search has no stop strings.
        structured_outputs: vLLM's structured outputs (must be None here).
        skip_special_tokens: Leave special tokens out of each sequence's `text`.
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
