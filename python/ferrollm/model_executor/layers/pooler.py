"""Pooling: turns a step's final hidden states into one result per request.

The step's tokens are one flat batch; request ``i`` owns rows ``query_start_loc[i] ..
query_start_loc[i + 1]``, always its whole prompt (pooling runs without chunked prefill). The
sequence methods (CLS, LAST, MEAN) are one gather or one ``index_add_`` for the whole batch; the
head then keeps the first ``dimensions`` features and L2-normalizes, per request's parameters,
in float32, as vLLM's embedding head does.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from ferrollm.pooling_params import PoolingParams

__all__ = ["Pooler", "pool_sequences"]


def pool_sequences(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """One float32 vector per request.

    Args:
        hidden: ``[num_tokens, hidden]``.
        query_start_loc: int ``[num_reqs + 1]`` on ``hidden``'s device.
        pooling_type: ``"CLS"`` (first token), ``"LAST"`` (last token) or ``"MEAN"``.

    Returns:
        ``[num_reqs, hidden]`` float32.
    """
    starts, ends = query_start_loc[:-1].long(), query_start_loc[1:].long()
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "MEAN":
        lengths = ends - starts
        owner = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)
        sums = torch.zeros(len(lengths), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, owner, hidden.float())
        return sums / lengths[:, None].float()
    raise ValueError(f"pooling type {pooling_type!r} is not a sequence pooling")


def _head(x: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    if dimensions is not None:
        x = x[..., :dimensions]
    return F.normalize(x, p=2, dim=-1) if normalize else x


class Pooler:
    """Pools a step for the model's pooling type (``embed``) or every token (``token_embed``).

    Args:
        pooling_type: the model's resolved sequence pooling, ``"CLS"``, ``"LAST"`` or
            ``"MEAN"`` (``"ALL"`` makes ``embed`` return every token too).
    """

    def __init__(self, pooling_type: str):
        self.pooling_type = pooling_type

    def __call__(self, hidden: torch.Tensor, query_start_loc: torch.Tensor,
                 params: list[PoolingParams]) -> list[torch.Tensor]:
        """Pools each request of the step.

        Args:
            hidden: ``[num_tokens, hidden]`` final hidden states of the step.
            query_start_loc: int ``[num_reqs + 1]``, on ``hidden``'s device.
            params: each request's verified parameters (``task``, ``dimensions``, ``normalize``).

        Returns:
            Per request, a float32 CPU tensor: ``[dim]`` for ``embed``, ``[num_tokens, dim]``
            for ``token_embed``.
        """
        out: list[torch.Tensor | None] = [None] * len(params)
        per_token = [i for i, p in enumerate(params) if p.task == "token_embed" or self.pooling_type == "ALL"]
        per_token_set = set(per_token)
        sequence = [i for i in range(len(params)) if i not in per_token_set]
        if sequence:
            if len(sequence) == len(params):
                loc, part = query_start_loc, hidden
            else:  # a step mixing both tasks: pool only these requests' tokens
                loc, part = self._select(hidden, query_start_loc, sequence)
            pooled = pool_sequences(part, loc, self.pooling_type)
            for i, vec in zip(sequence, self._apply_heads(pooled, [params[i] for i in sequence])):
                out[i] = vec
        if per_token:
            bounds = query_start_loc.tolist()
            for i in per_token:
                tokens = hidden[bounds[i]:bounds[i + 1]].float()
                out[i] = _head(tokens, params[i].dimensions, bool(params[i].normalize)).cpu()
        return [t for t in out if t is not None]

    @staticmethod
    def _select(hidden: torch.Tensor, query_start_loc: torch.Tensor, rows: list[int]):
        """The tokens of ``rows`` only, and their own ``query_start_loc``."""
        bounds = query_start_loc.tolist()
        index = torch.cat([torch.arange(bounds[r], bounds[r + 1], device=hidden.device) for r in rows])
        lengths = torch.tensor([bounds[r + 1] - bounds[r] for r in rows], device=hidden.device)
        loc = torch.zeros(len(rows) + 1, dtype=torch.long, device=hidden.device)
        loc[1:] = torch.cumsum(lengths, 0)
        return loc, hidden[index]

    @staticmethod
    def _apply_heads(pooled: torch.Tensor, params: list[PoolingParams]) -> list[torch.Tensor]:
        """Applies each request's head; requests with the same head share one call."""
        groups: dict[tuple[int | None, bool], list[int]] = defaultdict(list)
        for i, p in enumerate(params):
            groups[(p.dimensions, bool(p.normalize))].append(i)
        result: list[torch.Tensor | None] = [None] * len(params)
        for (dimensions, normalize), rows in groups.items():
            index = torch.tensor(rows, device=pooled.device)
            done = _head(pooled[index], dimensions, normalize).cpu()
            for row, vec in zip(rows, done):
                result[row] = vec
        return [t for t in result if t is not None]
