"""The Rust core's configuration from the engine's options: the step's token budget, chunked
prefill, the multimodal scheduling rules, and the pooling models' one-step core and cache."""

from __future__ import annotations

import torch

from ferrollm._core import EngineCore
from ferrollm.attention.backend import allocate_kv_cache
from ferrollm.config.model_config import ModelConfig
from ferrollm.engine.arg_utils import EngineArgs
from ferrollm.engine.kv_memory import kv_cache_torch_dtype
from ferrollm.engine.tokenizer_loader import Tokenizers
from ferrollm.exceptions import ConfigError
from ferrollm.worker.pooling_runner import PoolingModelRunner

__all__ = ["batched_tokens", "bidirectional_mm", "build_core", "build_pooling_core", "check_whole_mm_items",
           "chunked_prefill"]


def chunked_prefill(args: EngineArgs) -> bool:
    """vLLM's default for a generative model: on."""
    return True if args.enable_chunked_prefill is None else bool(args.enable_chunked_prefill)


def batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """`max_num_batched_tokens`, by default 8192 (or `max_num_seqs`), but never more than
    `max_num_seqs` sequences of `max_model_len` can hold: a step's activations grow with its tokens,
    so lowering either option lowers the peak. Without chunked prefill the default rises to
    `max_model_len`, so any prompt fits a step, as in vLLM; a smaller explicit value is refused."""
    if args.max_num_batched_tokens is None:
        default = max(8192, args.max_num_seqs)
        if not chunked_prefill(args):
            default = max(default, max_model_len)
        return min(default, max_model_len * args.max_num_seqs)
    if not chunked_prefill(args) and args.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"max_num_batched_tokens ({args.max_num_batched_tokens}) is smaller than max_model_len "
            f"({max_model_len}). This effectively limits the maximum sequence length to max_num_batched_tokens "
            "and makes vLLM reject longer sequences. Please increase max_num_batched_tokens or decrease "
            "max_model_len (or keep enable_chunked_prefill on).")
    return args.max_num_batched_tokens


def build_core(args: EngineArgs, mc: ModelConfig, window: int | None, num_blocks: int,
                tokenizers: Tokenizers, encoder_budget: int = 0, stream_outputs: bool = False) -> EngineCore:
    batched = batched_tokens(args, mc.max_model_len)
    return EngineCore(
        tokenizer=tokenizers.core, block_size=args.block_size, num_blocks=num_blocks,
        enable_prefix_caching=args.enable_prefix_caching, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, max_model_len=mc.max_model_len, sliding_window=window,
        enable_chunked_prefill=chunked_prefill(args), long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy, max_num_encoder_input_tokens=max(batched, encoder_budget),
        disable_chunked_mm_input=bidirectional_mm(mc),
        stream_outputs=stream_outputs,
    )


def check_whole_mm_items(args: EngineArgs, mc: ModelConfig, batched: int, tokens_per_item: int) -> None:
    """A model whose steps take each image whole needs a step (and a request's share of one)
    that holds an image's tokens, or an image prompt could never be scheduled."""
    if not tokens_per_item or not bidirectional_mm(mc):
        return
    for name, value in (("max_num_batched_tokens", batched),
                        ("long_prefill_token_threshold", args.long_prefill_token_threshold or tokens_per_item)):
        if value < tokens_per_item:
            raise ConfigError(f"`{name}` must be >= {tokens_per_item} (the tokens of one image, which "
                              f"{mc.architecture} schedules in one step), or pass limit_mm_per_prompt="
                              f"{{'image': 0}} for text only. Given: {value}")


def bidirectional_mm(mc: ModelConfig) -> bool:
    """Whether the model attends both ways inside an image (Gemma 3): the scheduler must then
    never split an image across steps (vLLM's `disable_chunked_mm_input`)."""
    from ferrollm.model_executor.registry import ModelRegistry

    archs = list(getattr(mc.hf_config, "architectures", None) or [])
    return bool(getattr(ModelRegistry.resolve(archs), "bidirectional_mm_attention", False))


def build_pooling_core(args: EngineArgs, mc: ModelConfig, model, tokenizers: Tokenizers,
                        device: torch.device):
    """A core whose steps hold whole prompts, and a KV cache (decoders only) for one step.
    Prefix caching is off whatever `enable_prefix_caching` says, as in vLLM for encoders.

    Every request finishes in the step that schedules it, so blocks never outlive a step: the
    pool holds one step's worth (each request's prompt rounded up to blocks). The core's
    `max_model_len` leaves room for the one placeholder token past a `max_model_len` prompt.
    """
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < mc.max_model_len:
        raise ConfigError(
            f"`max_num_batched_tokens` must be >= max_model_len ({mc.max_model_len}) for a pooling model, "
            f"whose prompts are never split across steps. Given: {args.max_num_batched_tokens}")
    check_pooling_scheduling(args)
    core_len = mc.max_model_len + 1
    batched = max(args.max_num_batched_tokens or 8192, core_len, args.max_num_seqs)
    num_blocks = 1 + -(-batched // args.block_size) + args.max_num_seqs
    core = EngineCore(
        tokenizer=tokenizers.core, block_size=args.block_size, num_blocks=num_blocks,
        enable_prefix_caching=False, enable_chunked_prefill=False, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=batched, max_model_len=core_len, scheduling_policy=args.scheduling_policy,
    )
    spec = model.kv_cache_spec()
    kv_dtype = kv_cache_torch_dtype(args.kv_cache_dtype, mc.dtype)
    kv_caches = [] if spec is None else allocate_kv_cache(spec[0], num_blocks, args.block_size, spec[1], spec[2], kv_dtype, device)
    assert mc.pooler is not None
    return core, PoolingModelRunner(model, kv_caches, args.block_size, device, mc.pooler.pooling_type)


def check_pooling_scheduling(args: EngineArgs) -> None:
    """A pooling model's prompt is pooled in the step that holds all of it, and its cache holds
    that one step: options that split prompts or size the cache have nothing to act on."""
    refused = {"enable_chunked_prefill": (args.enable_chunked_prefill, (None, False)),
               "long_prefill_token_threshold": (args.long_prefill_token_threshold, (0,)),
               "num_gpu_blocks_override": (args.num_gpu_blocks_override, (None,)),
               "kv_cache_memory_bytes": (args.kv_cache_memory_bytes, (None,))}
    for name, (value, defaults) in refused.items():
        if value not in defaults:
            raise NotImplementedError(
                f"`{name}={value!r}` is not supported for a pooling model (runner='pooling'): each prompt is "
                "pooled in one step, and its KV cache holds just that step. Leave it at its default.")
