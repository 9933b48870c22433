"""`PoolingParams`: what a user asks of one pooling request (an embedding), with vLLM's fields.

Construction checks each field's type and bound; :meth:`PoolingParams.verify` then checks the
request against the model (task supported, Matryoshka dimensions allowed, the model's pooler
defaults merged in). Errors are :class:`ferrollm.exceptions.InvalidRequestError` (a
``ValueError``) naming the field, the bound and the value given.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from ferrollm.exceptions import InvalidRequestError

if TYPE_CHECKING:
    from ferrollm.config.pooler_config import PoolingModelConfig

__all__ = ["PoolingParams", "PoolingTask", "POOLING_TASKS", "SUPPORTED_POOLING_TASKS"]

PoolingTask = str
# vLLM's task names; ferrollm runs the embedding ones.
POOLING_TASKS = ("embed", "token_embed", "classify", "token_classify", "score")
SUPPORTED_POOLING_TASKS = ("embed", "token_embed")


def _invalid(name: str, bound: str, value: Any) -> InvalidRequestError:
    return InvalidRequestError(f"`{name}` must be {bound}. Given: {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(eq=True, repr=False)
class PoolingParams:
    """Parameters of a pooling request, as in vLLM's offline API.

    Args:
        truncate_prompt_tokens: Keep only the last ``k`` prompt tokens (left truncation); -1
            means the model's ``max_model_len``; None disables truncation.
        dimensions: Keep the first ``dimensions`` features of the embedding (Matryoshka
            models only), before normalization.
        normalize: L2-normalize the embedding; None takes the model's default (on, unless the
            checkpoint's sentence-transformers config has no ``Normalize`` module).
        use_activation: vLLM's newer name for ``normalize`` on embedding tasks.
        task: ``"embed"`` or ``"token_embed"``; set by `LLM.embed`/`LLM.encode` when None.
    """

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: PoolingTask | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or not (t == -1 or t >= 1)):
            raise _invalid("truncate_prompt_tokens", "-1 (max_model_len), >= 1 or None", t)
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise _invalid("dimensions", ">= 1 or None", self.dimensions)
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise _invalid(name, "True, False or None", value)
        if (self.normalize is not None and self.use_activation is not None
                and self.normalize != self.use_activation):
            raise _invalid("use_activation", f"equal to normalize ({self.normalize}) when both are given",
                           self.use_activation)
        if self.task is not None and self.task not in POOLING_TASKS:
            raise _invalid("task", f"one of {list(POOLING_TASKS)} or None", self.task)

    def clone(self) -> PoolingParams:
        """A deep copy, so the engine can fill in defaults without touching the caller's object."""
        return copy.deepcopy(self)

    def verify(self, task: PoolingTask, pooler: PoolingModelConfig) -> None:
        """Checks the request against the model and fills in its defaults (in place).

        Args:
            task: the task of the call (`LLM.embed` -> ``"embed"``).
            pooler: the model's resolved pooler config.

        Raises:
            InvalidRequestError: a task other than the call's or one ferrollm does not run,
                ``dimensions`` on a model without Matryoshka support, outside its
                ``matryoshka_dimensions`` or above its hidden size.
        """
        if self.task is None:
            self.task = task
        elif self.task != task:
            raise _invalid("task", f"{task!r} for this call (or None)", self.task)
        if self.task not in SUPPORTED_POOLING_TASKS:
            raise _invalid("task", f"one of {list(SUPPORTED_POOLING_TASKS)} (the tasks ferrollm runs)", self.task)
        if self.normalize is None:
            self.normalize = self.use_activation if self.use_activation is not None else pooler.normalize
        self.use_activation = self.normalize
        if self.dimensions is not None:
            self._verify_dimensions(pooler)

    def _verify_dimensions(self, pooler: PoolingModelConfig) -> None:
        if not pooler.is_matryoshka:
            raise InvalidRequestError(
                f"`dimensions` needs a model trained with Matryoshka representation learning; "
                f"{pooler.model_name!r} is not marked as one (is_matryoshka or matryoshka_dimensions "
                f"in its config; hf_overrides={{'is_matryoshka': True}} marks it). Given: {self.dimensions}"
            )
        allowed = pooler.matryoshka_dimensions
        if allowed and self.dimensions not in allowed:
            raise _invalid("dimensions", f"one of the model's matryoshka_dimensions {list(allowed)}", self.dimensions)
        if self.dimensions > pooler.hidden_size:
            raise _invalid("dimensions", f"<= the model's embedding size ({pooler.hidden_size})", self.dimensions)

    def __repr__(self) -> str:
        parts = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))
        return f"PoolingParams({parts})"
