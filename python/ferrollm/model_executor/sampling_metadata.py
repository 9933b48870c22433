"""`SamplingMetadata`: one step's sampling inputs as tensors, built once per step.

The per-request values come from the core's `SchedulerOutput` arrays (row i = i-th scheduled
request); the lists (penalty token ids, logit bias, allowed ids) come from the runner, which keeps
each request's state. Batch-wide flags are computed on the numpy arrays, so the sampler can skip
whole stages without reading a device tensor back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["SAMPLING_EPS", "SamplingMetadata", "make_generator"]

# Below this temperature a row is greedy, as in vLLM.
SAMPLING_EPS = 1e-5

TokenLists = Sequence[Sequence[int]]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own generator; the runner keeps it for the request's whole life, so each step
    draws fresh numbers that depend only on the seed and the step count.

    Args:
        seed: The request's `SamplingParams.seed`.
        device: Where the logits live (a CUDA generator for CUDA logits).

    Returns:
        A seeded `torch.Generator`.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingMetadata:
    """The sampler's inputs for one step of `R` requests over a vocabulary of `V` tokens.

    Optional tensors are None when no row needs that stage. Build it with
    :meth:`from_arrays` or :meth:`from_scheduler_output`.

    Args:
        temperature: float32 [R]; rows below `SAMPLING_EPS` are greedy.
        all_greedy: Every row is greedy.
        all_random: No row is greedy.
        unit_temperature: Every temperature is exactly 1, so dividing by it changes nothing.
        top_p: float32 [R] (1 = off), or None.
        top_k: int64 [R] (0 = off), or None.
        max_top_k: The largest `top_k`, so top-k alone needs a `topk`, not a full sort.
        min_p: float32 [R] (0 = off), or None.
        generators: Row -> the request's own generator, for seeded random rows.
        max_num_logprobs: Most logprobs any row asks for (-1: all), or None for none.
        presence_penalties, frequency_penalties, repetition_penalties: float32 [R], or None
            when no row has a penalty.
        prompt_token_ids, output_token_ids: int64 [R, L] padded with `V`, when penalties apply.
        allowed_token_ids_mask: bool [R, V], True where a row may NOT sample the token.
        logit_bias: (rows, token ids, values) to add, or None.
        min_tokens_stop: (rows, token ids) that may not be sampled yet, or None.
        bad_words: (rows, token ids) a bad word's last token blocks this step, or None.
        logits_processors: Custom batch-level processors (vLLM v1's `LogitsProcessor`), run in
            order; each already knows the step's rows through `update_state`.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    unit_temperature: bool = False
    top_p: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    max_top_k: int = 0
    min_p: torch.Tensor | None = None
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    allowed_token_ids_mask: torch.Tensor | None = None
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    min_tokens_stop: tuple[torch.Tensor, torch.Tensor] | None = None
    bad_words: tuple[torch.Tensor, torch.Tensor] | None = None
    logits_processors: list[Any] = field(default_factory=list)

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @property
    def divides_by_temperature(self) -> bool:
        """Whether the sampler divides the logits by the temperatures: not where every row is
        greedy (nothing is drawn) or every row samples at exactly 1 (x / 1 is x)."""
        return not self.all_greedy and not (self.all_random and self.unit_temperature)

    @property
    def edits_logits(self) -> bool:
        """Whether a sampler stage writes into the logits in place (masks, biases, penalties, the
        temperature division); when none does, the sampler needs no private copy of them."""
        in_place = (self.allowed_token_ids_mask, self.min_tokens_stop, self.logit_bias, self.repetition_penalties,
                    self.bad_words)
        return (self.divides_by_temperature or bool(self.logits_processors)
                or any(stage is not None for stage in in_place))

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def from_arrays(
        cls,
        *,
        temperature: np.ndarray,
        top_p: np.ndarray,
        top_k: np.ndarray,
        min_p: np.ndarray,
        seeds: np.ndarray,
        presence_penalty: np.ndarray,
        frequency_penalty: np.ndarray,
        repetition_penalty: np.ndarray,
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: dict[int, torch.Generator] | None = None,
        prompt_token_ids: TokenLists | None = None,
        output_token_ids: TokenLists | None = None,
        logit_bias: Sequence[dict[int, float] | None] | None = None,
        allowed_token_ids: Sequence[Sequence[int] | None] | None = None,
        min_tokens_stop_ids: Sequence[Sequence[int] | None] | None = None,
        max_num_logprobs: int | None = None,
        bad_words_ids: Sequence[Sequence[int] | None] | None = None,
        logits_processors: Sequence[Any] = (),
    ) -> SamplingMetadata:
        """Builds one step's metadata from the core's per-request arrays and runner extras.

        Args:
            temperature, top_p, top_k, min_p, seeds, presence_penalty, frequency_penalty,
                repetition_penalty: The `SchedulerOutput` arrays, one row per request
                (`seeds` is -1 where unset; `top_k` <= 0 is off).
            vocab_size: Width of the logits the sampler will get.
            device: Where the logits live.
            generators: Row -> generator for every seeded random row (see `make_generator`).
            prompt_token_ids: Per row, the prompt's ids; needed when any penalty is set
                (rows without a penalty may give an empty list).
            output_token_ids: Per row, the ids generated so far; needed with penalties.
            logit_bias: Per row, token id -> bias, or None.
            allowed_token_ids: Per row, the only ids it may sample, or None.
            min_tokens_stop_ids: Per row, the EOS and stop token ids while the request has
                fewer than `min_tokens` outputs, else None.
            max_num_logprobs: Most logprobs any row asks for (-1: all), or None.
            bad_words_ids: Per row, the token ids its bad words block this step, or None.
            logits_processors: The engine's custom logits processors.

        Returns:
            The step's `SamplingMetadata`.

        Raises:
            ValueError: A seeded random row has no generator, or penalties are set without
                the token ids they need.
        """
        temperature = np.asarray(temperature, dtype=np.float32)
        greedy = temperature < SAMPLING_EPS
        generators = dict(generators or {})
        _check_generators(seeds, greedy, generators)
        as_tensor = _to_device(device)
        meta = cls(
            temperature=as_tensor(temperature),
            all_greedy=bool(greedy.all()),
            all_random=not bool(greedy.any()),
            unit_temperature=bool((temperature == 1.0).all()),
            generators=generators,
            max_num_logprobs=max_num_logprobs,
            logits_processors=list(logits_processors),
        )
        sampling = ~greedy  # filters only matter for the rows that sample
        _set_filters(meta, as_tensor, sampling, np.asarray(top_p), np.asarray(top_k),
                     np.asarray(min_p))
        _set_penalties(meta, as_tensor, vocab_size, presence_penalty, frequency_penalty,
                       repetition_penalty, prompt_token_ids, output_token_ids)
        meta.logit_bias = _bias_index(logit_bias, device)
        meta.allowed_token_ids_mask = _allowed_mask(allowed_token_ids, vocab_size, device)
        meta.min_tokens_stop = _index_pairs(min_tokens_stop_ids, device)
        meta.bad_words = _index_pairs(bad_words_ids, device)
        return meta

    @classmethod
    def from_scheduler_output(cls, step: Any, **extras: Any) -> SamplingMetadata:
        """Like :meth:`from_arrays`, reading the eight per-request arrays from a
        `ferrollm.SchedulerOutput`.

        Args:
            step: The step from `EngineCore.schedule()`.
            **extras: The other keyword arguments of :meth:`from_arrays` (`vocab_size` is
                required).

        Returns:
            The step's `SamplingMetadata`.
        """
        names = ("temperature", "top_p", "top_k", "min_p", "seeds", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")
        return cls.from_arrays(**{n: getattr(step, n) for n in names}, **extras)


def _to_device(device: torch.device | str):
    # from_numpy shares the core's buffer; the copy happens once, on the way to the device.
    return lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)


def _check_generators(seeds: np.ndarray, greedy: np.ndarray,
                      generators: dict[int, torch.Generator]) -> None:
    """A seeded row without its own generator would silently draw from the shared one and
    lose reproducibility, so it is an error in the runner."""
    seeded = np.flatnonzero((np.asarray(seeds) != -1) & ~greedy)
    missing = [int(r) for r in seeded if int(r) not in generators]
    if missing:
        raise ValueError(f"seeded rows {missing} have no generator; build one per request "
                         "with make_generator(seed) and keep it across steps")


def _set_filters(meta: SamplingMetadata, as_tensor, sampling: np.ndarray, top_p: np.ndarray,
                 top_k: np.ndarray, min_p: np.ndarray) -> None:
    if (sampling & (top_p < 1.0)).any():
        meta.top_p = as_tensor(top_p.astype(np.float32))
    k = np.where(sampling & (top_k > 0), top_k, 0).astype(np.int64)
    if k.any():
        meta.top_k = as_tensor(k)
        meta.max_top_k = int(k.max())
    if (sampling & (min_p > SAMPLING_EPS)).any():
        meta.min_p = as_tensor(min_p.astype(np.float32))


def _set_penalties(meta: SamplingMetadata, as_tensor, vocab_size: int, presence, frequency,
                   repetition, prompt_ids: TokenLists | None,
                   output_ids: TokenLists | None) -> None:
    presence, frequency, repetition = (np.asarray(a, dtype=np.float32)
                                       for a in (presence, frequency, repetition))
    if not ((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any()):
        return
    if prompt_ids is None or output_ids is None:
        raise ValueError("penalties need prompt_token_ids and output_token_ids")
    meta.presence_penalties = as_tensor(presence)
    meta.frequency_penalties = as_tensor(frequency)
    meta.repetition_penalties = as_tensor(repetition)
    meta.prompt_token_ids = as_tensor(_pad(prompt_ids, vocab_size))
    meta.output_token_ids = as_tensor(_pad(output_ids, vocab_size))


def _pad(rows: TokenLists, pad: int) -> np.ndarray:
    """[R, longest] int64; `pad` (= V) lands in a spare bin the penalties drop."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), max(width, 1)), pad, dtype=np.int64)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


def _index_pairs(per_row: Sequence[Sequence[int] | None] | None,
                 device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) for per-row id lists, or None when every row has none."""
    if per_row is None:
        return None
    lists = [np.asarray(ids if ids is not None else [], dtype=np.int64) for ids in per_row]
    lens = [len(a) for a in lists]
    if not any(lens):
        return None
    rows = np.repeat(np.arange(len(lists), dtype=np.int64), lens)
    cols = np.concatenate(lists)
    return torch.from_numpy(rows).to(device), torch.from_numpy(cols).to(device)


def _bias_index(bias: Sequence[dict[int, float] | None] | None,
                device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if bias is None:
        return None
    pairs = _index_pairs([list(b) if b else None for b in bias], device)
    if pairs is None:
        return None
    values = np.fromiter((v for b in bias if b for v in b.values()), dtype=np.float32)
    return pairs[0], pairs[1], torch.from_numpy(values).to(device)


def _allowed_mask(allowed: Sequence[Sequence[int] | None] | None, vocab_size: int,
                  device) -> torch.Tensor | None:
    if allowed is None or all(ids is None for ids in allowed):
        return None
    restricted = torch.tensor([ids is not None for ids in allowed], device=device)
    mask = restricted.unsqueeze(1).repeat(1, vocab_size)
    pairs = _index_pairs(allowed, device)
    if pairs is not None:
        mask[pairs] = False
    return mask
