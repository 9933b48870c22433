"""``torch.compile`` of the model's forward at vLLM's `CompilationLevel`.

- ``NO_COMPILATION`` (0, ferrollm's default): the model runs eagerly; CUDA graphs still capture
  its decode steps.
- ``DYNAMO_AS_IS`` (1): ``torch.compile`` as it comes, with ``compilation_config.backend``
  (default ``inductor``): Dynamo guards every call and recompiles when a guard fails (a new
  token count is made dynamic on the second size it sees).
- ``DYNAMO_ONCE`` (2): compiled once, with the token count dynamic, then no guard is evaluated
  again (``set_stance(skip_guard_eval_unsafe=True)``), which is what vLLM's custom dispatcher
  does: the engine's inputs never change type, rank or dtype, only the token count.
- ``PIECEWISE`` (3): like ``DYNAMO_ONCE``, but the graph is cut at every attention call
  (:func:`~ferrollm.attention.forward_context.unified_attention`); the pieces between are
  compiled with the backend and the attention calls run as they are. CUDA graphs are then
  captured over the compiled pieces and the attention kernels together.

In every compiled level the attention layers call one opaque custom op that reads the step's
metadata from the forward context (attention/forward_context.py), so the trace never holds a
per-step value. ``compute_logits`` stays eager: it runs on the sampled rows only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.forward_context import bind_kv_cache_indices, set_forward_context, unified_attention
from ferrollm.config.compilation import CompilationConfig, CompilationLevel

__all__ = ["CompiledForward", "PiecewiseBackend", "compile_model"]

logger = logging.getLogger("ferrollm")


def compile_model(model: torch.nn.Module, config: CompilationConfig) -> CompiledForward | None:
    """The compiled forward of ``model`` at ``config.level``, or None for ``NO_COMPILATION``.

    Call :meth:`CompiledForward.warm_up` (which numbers the attention layers and compiles) before
    the first step.
    """
    level = CompilationLevel(config.level or CompilationLevel.NO_COMPILATION)
    if level == CompilationLevel.NO_COMPILATION:
        return None
    return CompiledForward(model, level, config.backend or "inductor")


class CompiledForward:
    """``model(input_ids, positions, kv_caches, attn_metadata)``, compiled.

    Args:
        model: a ferrollm model.
        level: a compiled level (1-3).
        backend: ``"inductor"``, ``"eager"``, ``"aot_eager"`` or any registered Dynamo backend.
    """

    def __init__(self, model: torch.nn.Module, level: CompilationLevel, backend: str):
        self.model = model
        self.level = level
        self.backend = backend
        self.piecewise = PiecewiseBackend(backend) if level == CompilationLevel.PIECEWISE else None
        self._compiled = torch.compile(self._forward, backend=self.piecewise or backend, fullgraph=False)
        # DYNAMO_ONCE and PIECEWISE compile once; afterwards guards are skipped.
        self._once = level >= CompilationLevel.DYNAMO_ONCE
        self._compiled_once = False
        self.compile_seconds = 0.0

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor]):
        return self.model(input_ids, positions, kv_caches, None)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn_metadata: AttentionMetadata) -> torch.Tensor:
        with set_forward_context(attn_metadata, kv_caches):
            if not self._compiled_once:
                return self._compiled(input_ids, positions, kv_caches)
            try:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return self._compiled(input_ids, positions, kv_caches)
            except RuntimeError as e:
                # A shape class the warm-up did not cover: the call ran nothing, so evaluate the
                # guards from now on and let Dynamo compile it.
                if "skip_guard_eval_unsafe" not in str(e):
                    raise
                logger.warning("torch.compile: a step of %d tokens needed a new compile; guards are "
                               "evaluated from now on", input_ids.shape[0])
                self._compiled_once = False
                return self._compiled(input_ids, positions, kv_caches)

    def warm_up(self, make_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]],
                kv_caches: list[torch.Tensor], num_tokens: int) -> None:
        """Numbers the attention layers (one eager forward), then compiles.

        Args:
            make_batch: ``n -> (input_ids, positions, attn_metadata)``, a batch of ``n`` tokens
                that writes nothing to the cache (padding slots).
            kv_caches: the caches every later step passes.
            num_tokens: the token count to compile the dynamic graph with (>= 3).

        The compile-once levels mark the token count dynamic on a ``num_tokens`` batch, then
        run 2 and 1 tokens too: Dynamo specializes sizes 0 and 1, and the GPU's linear layers
        check for the CPU kernels' two-row GEMV first, so sizes 1, 2 and >= 3 are three shape
        classes. After that no guard is evaluated.
        """
        def eager_forward() -> list[torch.Tensor]:
            input_ids, positions, meta = make_batch(1)
            self.model(input_ids, positions, kv_caches, meta)
            return kv_caches

        with torch.inference_mode():
            bind_kv_cache_indices(self.model, eager_forward)
        start = time.perf_counter()
        for i, n in enumerate((max(3, num_tokens), 2, 1)):
            with torch.inference_mode():
                # Steps run under inference mode: inputs made outside it would not match the guards.
                input_ids, positions, meta = make_batch(n)
                input_ids, positions = input_ids.clone(), positions.clone()
                if self._once and i == 0:
                    torch._dynamo.mark_dynamic(input_ids, 0)
                    torch._dynamo.mark_dynamic(positions, 0)
                self(input_ids, positions, kv_caches, meta)
        if kv_caches and kv_caches[0].device.type == "cuda":
            torch.cuda.synchronize(kv_caches[0].device)
        self._compiled_once = self._once
        self.compile_seconds = time.perf_counter() - start
        pieces = "" if self.piecewise is None else f", {self.piecewise.describe()}"
        logger.info("torch.compile (%s, backend %s) took %.2f s%s", self.level.name, self.backend,
                    self.compile_seconds, pieces)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def _is_attention(node: fx.Node) -> bool:
    op = torch.ops.ferrollm.unified_attention
    return node.op == "call_function" and (node.target is op or node.target is op.default
                                           or node.target is unified_attention)


class PiecewiseBackend:
    """A Dynamo backend that cuts each graph at its attention calls and compiles the pieces.

    Args:
        inner: the backend each piece between attention calls is compiled with.
    """

    def __init__(self, inner: str):
        self.inner = inner
        self.num_graphs = 0
        self.num_compiled_pieces = 0
        self.num_attention_pieces = 0

    def describe(self) -> str:
        return (f"{self.num_graphs} graph(s) cut into {self.num_compiled_pieces} compiled pieces around "
                f"{self.num_attention_pieces} attention calls")

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.num_graphs += 1
        split, attention = split_at_attention(gm)
        pieces = {name for name, _ in split.named_children() if name not in attention}
        self.num_attention_pieces += len(attention)
        self.num_compiled_pieces += len(pieces)
        if self.inner != "eager":
            _CompilePieces(split, pieces, self._compile_piece).run(*example_inputs)
        return split

    def _compile_piece(self, piece: fx.GraphModule, args: list[Any]) -> Callable[..., Any]:
        if self.inner == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(piece, args)
        return torch._dynamo.lookup_backend(self.inner)(piece, args)


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, set[str]]:
    """Splits ``gm`` into submodules, each attention call alone in its own.

    Returns:
        The split module (calling ``submod_0``, ``submod_1``, ... in order) and the names of the
        submodules that hold an attention call.
    """
    part, parts, attention_parts = 0, {}, set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if _is_attention(node):
            part += 1
            parts[node] = part
            attention_parts.add(part)
            part += 1
        else:
            parts[node] = part
    split = split_module(gm, None, lambda n: parts[n], keep_original_order=True)
    return split, {f"submod_{p}" for p in attention_parts}


class _CompilePieces(fx.Interpreter):
    """Runs the split graph on fake tensors, so each piece is compiled with its own inputs'
    shapes (symbolic ones included), and puts each compiled piece in place of its submodule."""

    def __init__(self, module: fx.GraphModule, pieces: set[str], compile_piece):
        super().__init__(module)
        self.pieces = pieces
        self.compile_piece = compile_piece

    def run(self, *args: Any) -> Any:
        from torch._guards import detect_fake_mode

        from torch._subclasses.fake_tensor import FakeTensor

        # Dynamo hands over real tensors (parameters among them); its fake mode has already seen
        # them, so `from_tensor` gives back their fakes, symbolic token counts included.
        fake_mode = detect_fake_mode(args) or torch._guards.TracingContext.get().fake_mode
        args = tuple(fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) and not isinstance(a, FakeTensor) else a
                     for a in args)
        with fake_mode:
            return super().run(*args)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        out = super().call_module(target, args, kwargs)
        if target in self.pieces:
            piece = self.fetch_attr(target)
            self.module.__dict__[target] = self.compile_piece(piece, list(args))
        return out
