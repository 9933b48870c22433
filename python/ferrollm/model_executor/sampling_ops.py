"""The sampler's batched tensor operations, each over all rows at once ([R, V] logits).

Functions ending in `_` change `logits` in place; the sampler owns a private copy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ferrollm.kernels import cpu as cpu_kernels

__all__ = [
    "LogprobsTensors",
    "apply_min_p",
    "apply_penalties_",
    "apply_top_k_top_p",
    "gather_logprobs",
    "random_sample",
]

_NEG_INF = float("-inf")


class LogprobsTensors(NamedTuple):
    """Log probabilities for N positions, the chosen token first.

    Args:
        logprob_token_ids: int64 [N, k+1]: the chosen (sampled or prompt) token, then the top k.
        logprobs: float32 [N, k+1], matching `logprob_token_ids`.
        ranks: int64 [N]: the chosen token's rank (1 = most likely).
    """

    logprob_token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] occurrence counts of padded ids; the pad value V falls in a bin that is dropped."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int32,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties_(logits: torch.Tensor, prompt_ids: torch.Tensor, output_ids: torch.Tensor,
                     presence: torch.Tensor, frequency: torch.Tensor,
                     repetition: torch.Tensor) -> None:
    """vLLM's penalties, in its order: repetition on every token seen in the prompt or output
    (divide positive logits, multiply negative ones), then frequency (times the output count)
    and presence (once per token in the output).

    Args:
        logits: float32 [R, V], changed in place.
        prompt_ids, output_ids: int64 [R, L] padded with V.
        presence, frequency, repetition: float32 [R].
    """
    vocab_size = logits.shape[1]
    output_counts = _bin_counts(output_ids, vocab_size)
    in_output = output_counts > 0
    seen = in_output | (_bin_counts(prompt_ids, vocab_size) > 0)
    rep = repetition.unsqueeze(1)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    logits.mul_(torch.where(seen, scale, torch.ones_like(scale)))
    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * in_output)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drops tokens whose probability is below `min_p` times the likeliest token's.

    Args:
        logits: float32 [R, V] after temperature.
        min_p: float32 [R]; 0 keeps every token of that row.

    Returns:
        The logits with dropped tokens at -inf.
    """
    probs = logits.softmax(dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < floor, _NEG_INF)


def _top_k_only(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """Top-k without a full sort: the k-th largest value comes from one `topk(max_k)`."""
    max_k = min(max_k, logits.shape[1])
    top = logits.topk(max_k, dim=-1).values
    kth = top.gather(1, (k.clamp(1, max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill((k <= 0).unsqueeze(1), _NEG_INF)  # rows with top-k off keep all
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, max_k: int,
                      p: torch.Tensor | None) -> torch.Tensor:
    """Keeps each row's `k` likeliest tokens (ties with the k-th kept), then the smallest
    prefix of those whose probability reaches `p` (the first token always kept).

    Args:
        logits: float32 [R, V] after temperature.
        k: int64 [R] (0 = off), or None.
        max_k: The largest value in `k`.
        p: float32 [R] (1 = off), or None.

    Returns:
        The logits with dropped tokens at -inf.
    """
    if p is None:
        return logits if k is None else _top_k_only(logits, k, max_k)
    ordered, order = logits.sort(dim=-1, descending=True)
    if k is not None:
        kth = ordered.gather(1, (k.clamp(1, logits.shape[1]) - 1).unsqueeze(1))
        kth = kth.masked_fill((k <= 0).unsqueeze(1), _NEG_INF)
        ordered = ordered.masked_fill(ordered < kth, _NEG_INF)
    probs = ordered.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # p = 1 keeps everything even where rounding lets the running sum touch 1 early.
    drop = (mass_before >= p.unsqueeze(1)) & (p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, ordered)


def greedy_sample(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima; a NaN counts as the largest, as in torch).

    On the CPU, NumPy's argmax takes it: torch's ran at ~2 GB/s, 0.28 ms for one row of Qwen2's
    151,936 logits (2% of a quantized batch-1 decode step), NumPy's at 11 µs. bf16 (which NumPy
    lacks) and GPU logits keep torch's.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def sample_logits(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draws one token per row with probability ``softmax(logits)``, as :func:`random_sample`
    draws from the probabilities (the same one uniform number per row on the CPU, from the row's
    own generator where it has one).

    On the CPU with fp32 logits the Rust kernel draws straight from the logits (``-inf`` ones
    have no mass): torch's softmax and two-level search took ~0.3 ms per row in a dozen small
    ops, ~7% of a SmolLM2 decode step, the kernel ~0.03 ms.
    """
    if logits.dtype == torch.float32 and cpu_kernels.supports(logits):
        return cpu_kernels.sample_rows(logits, row_uniforms(logits.shape[0], generators))
    return random_sample(logits.softmax(dim=-1), generators)


def row_uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[rows, 1] float64 uniform numbers in [0, 1): seeded rows from their own generator, one
    number per step, so their draws do not depend on the batch."""
    u = torch.empty(rows, 1, dtype=torch.float64)
    if len(generators) < rows:
        u.uniform_()
    for row, gen in generators.items():
        u[row].uniform_(generator=gen)
    return u


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draws one token per row: argmax(probs / q) with q ~ Exp(1) picks token i with
    probability probs[i], and needs no cumulative sum.

    A seeded row draws its q only from its own generator, V numbers per step whatever else
    is in the batch, so its tokens do not depend on the batch it shares.

    Args:
        probs: float32 [R, V].
        generators: Row -> generator for seeded rows; other rows use torch's default one.

    Returns:
        int64 [R] token ids.
    """
    if probs.device.type == "cpu":
        return _inverse_cdf_sample(probs, generators)
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # An exact 0 would turn a zero-probability token into 0/0 = NaN, which argmax prefers.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div(q).argmax(dim=-1)


def _inverse_cdf_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One uniform number per row against the row's cumulative distribution.

    On the CPU, drawing V exponentials is the cost: 117 ms for 32 rows of a 151936-word
    vocabulary on the 2-core development machine. A float64 cumulative sum over the whole row
    still took ~35 ms per step, so the search runs in two levels: the masses of blocks of
    `_CDF_BLOCK` tokens (one float32 sum pass), a float64 cumulative sum and search over the
    blocks, then a float64 cumulative sum inside the one chosen block per row, so tail tokens
    keep their mass. A seeded row draws its
    one number from its own generator, so its tokens still do not depend on the batch.
    """
    rows, vocab = probs.shape
    u = row_uniforms(rows, generators)
    block_cdf = _block_masses(probs).double().cumsum(dim=-1)
    # Scaled by the row's total, so rounding in the sums never leaves u past the last token.
    target = u * block_cdf[:, -1:]
    block = _first_above(block_cdf, target)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    first = block * _CDF_BLOCK
    cols = first + torch.arange(_CDF_BLOCK)
    inner = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    offset = _first_above(inner.double().cumsum(dim=-1), target - before)
    return (first + offset).squeeze(1)


# Tokens per block of the two-level search: one inner cumulative sum is this long.
_CDF_BLOCK = 256


def _block_masses(probs: torch.Tensor) -> torch.Tensor:
    """[R, ceil(V / _CDF_BLOCK)] float32 sums of consecutive blocks (the last may be short).

    Summed in float32 (a float64 reduction converts first and is 100x slower); a block's sum
    and its inner cumulative sum may then disagree by rounding, which `_first_above` absorbs.
    """
    rows, vocab = probs.shape
    whole = vocab - vocab % _CDF_BLOCK
    masses = probs[:, :whole].view(rows, -1, _CDF_BLOCK).sum(dim=-1)
    if whole == vocab:
        return masses
    return torch.cat([masses, probs[:, whole:].sum(dim=-1, keepdim=True)], dim=1)


def _first_above(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative value exceeds `target` [R, 1]; never past the
    first index holding the row's total, which has nonzero mass, whatever the rounding."""
    idx = torch.searchsorted(cdf, target, right=True)
    return torch.minimum(idx, torch.searchsorted(cdf, cdf[:, -1:].contiguous()))


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: int) -> LogprobsTensors:
    """The chosen token's logprob and rank, plus the top `num_logprobs`.

    Args:
        logprobs: float32 [N, V] log-softmax values.
        token_ids: int64 [N] chosen tokens.
        num_logprobs: How many top entries to return; -1 returns all V.

    Returns:
        `LogprobsTensors` with k + 1 columns, the chosen token first.
    """
    k = logprobs.shape[1] if num_logprobs == -1 else min(num_logprobs, logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)
    chosen = token_ids.long().unsqueeze(1)
    chosen_values = logprobs.gather(1, chosen)
    # Rank = how many tokens are at least as likely, so rank 1 is the argmax (as vLLM counts).
    ranks = (logprobs >= chosen_values).sum(dim=-1)
    return LogprobsTensors(
        torch.cat((chosen, top_ids), dim=1),
        torch.cat((chosen_values, top_values), dim=1),
        ranks,
    )
