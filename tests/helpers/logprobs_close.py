"""vLLM's `check_logprobs_close` rule, shared by the tests that compare two engines (or two
devices, or two precisions) whose sums may round a near tie either way."""

from __future__ import annotations


def top_logprobs(completion) -> list[dict[int, float]]:
    """A `CompletionOutput`'s per-step top log-probabilities as ``{token: logprob}`` dicts."""
    return [{t: lp.logprob for t, lp in step.items()} for step in completion.logprobs]


def check_logprobs_close(ours: tuple[list[int], list[dict[int, float]]],
                         theirs: tuple[list[int], list[dict[int, float]]], what: str,
                         tol: float | None = None) -> int:
    """Tokens equal up to the first difference, where each side's token must be in the other's
    top-k (a near tie); with ``tol``, each equal token's log-probabilities within it. Returns how
    many tokens were equal."""
    for i, (a, b) in enumerate(zip(ours[0], theirs[0])):
        if a != b:
            assert a in theirs[1][i] and b in ours[1][i], f"{what}: position {i}: {a} vs {b}, not a near tie"
            return i
        if tol is not None:
            assert abs(ours[1][i][a] - theirs[1][i][b]) < tol, \
                f"{what}: position {i}: logprob {ours[1][i][a]} vs {theirs[1][i][b]}"
    return min(len(ours[0]), len(theirs[0]))
