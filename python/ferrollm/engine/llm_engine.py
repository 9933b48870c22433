"""`LLMEngine`: builds the model, the KV cache, the tokenizers and the Rust core from the user's
options, and runs steps. The step loop is the one in DESIGN.md: schedule in Rust, execute in
torch, update in Rust.

A pooling model (``runner="pooling"``) goes through the same loop: its core is built without
chunked prefill and prefix caching, each request asks for one token, and the runner pools the
prompt's hidden states instead of sampling (see ``worker/pooling_runner.py``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ferrollm._core import EngineCore, EngineCoreOutput, SamplingOptions
from ferrollm.config.compilation import CompilationConfig
from ferrollm.config.generation_config import default_sampling_fields
from ferrollm.config.model_config import ModelConfig, build_model_config, text_config_of
from ferrollm.config.model_source import resolve_model_source
from ferrollm.config.vllm import VllmConfig, build_vllm_config
from ferrollm.engine.arg_utils import EngineArgs
from ferrollm.engine.async_outputs import AsyncOutputs
from ferrollm.engine.core_builder import batched_tokens, build_core, build_pooling_core, check_whole_mm_items
from ferrollm.engine.startup_report import (
    KVCacheSummary,
    StartupClock,
    activation_workspace_bytes,
    log_memory,
    model_weight_bytes,
)
from ferrollm.engine.stats import StatsTracker
from ferrollm.model_executor.dummy_weights import check_dummy_source, dummy_weights
from ferrollm.engine.tokenizer_loader import SKIPPED, Tokenizers, load_tokenizers
from ferrollm.exceptions import ConfigError, EngineError, InvalidRequestError
from ferrollm.pooling_params import PoolingParams
from ferrollm.sampling_params import SamplingParams
from ferrollm.executor import ExternalLauncherExecutor, MultiprocExecutor
from ferrollm.executor.launch import check_not_bootstrapping, check_tp_shapes
from ferrollm.multimodal.inputs import MultiModalInputs
from ferrollm.multimodal.setup import MultiModalProcessor, build_mm_processor
from ferrollm.v1.sample.logits_processor import STR_POOLING_REJECTS_LOGITSPROCS
from ferrollm.worker.logits_processors import LogitsProcessorBatch, validate_request
from ferrollm.worker.model_runner import ModelRunner
from ferrollm.worker.pooling_runner import PoolingModelRunner
from ferrollm.worker.worker import CacheOptions, Worker


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not name.startswith("cuda:"):
        raise ConfigError(f"`device` must be 'auto', 'cpu' or 'cuda'. Given: {name!r}")
    return torch.device(name)


class LLMEngine:
    """The loaded engine. Build it with `LLMEngine.from_args`."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, tokenizers: Tokenizers,
                 core: EngineCore, runner: ModelRunner | PoolingModelRunner,
                 executor: MultiprocExecutor | ExternalLauncherExecutor | None = None):
        self.args = args
        self.executor = executor
        # Wall time every rank took to load its weights (the slowest rank's).
        self.model_load_seconds = 0.0
        self.memory_profile = None
        self.model_config = model_config
        self.tokenizers = tokenizers
        self.core = core
        self.runner = runner
        # Images through the checkpoint's processor (multimodal models only).
        self.mm_processor: MultiModalProcessor | None = None
        # KV blocks allocated; `_from_workers` sets the exact count (a pooling engine's core
        # holds them all free at start).
        self.num_gpu_blocks = int(core.stats()["num_free_blocks"])
        # Per-request timing and the throughput log, unless disabled (`LLM` disables them).
        self.stats = None if args.disable_log_stats else StatsTracker()
        # `async_scheduling`: each step's core update runs beside the caller (async_outputs.py).
        self._pending = AsyncOutputs() if args.async_scheduling else None
        if isinstance(runner, ModelRunner):
            runner.sampler.logprobs_mode = args.logprobs_mode
            if args.logits_processor_classes:
                vllm_config = self.vllm_config
                runner.logits_processors = LogitsProcessorBatch(
                    [cls(vllm_config, runner.device, False) for cls in args.logits_processor_classes])
        # The model's recommended SamplingParams fields (generation_config.json), for
        # `LLM.get_default_sampling_params`.
        self.default_sampling_fields = default_sampling_fields(
            args.generation_config, model_config.source.folder, args.override_generation_config,
            has_file=not model_config.source.is_gguf)

    @classmethod
    def from_args(cls, args: EngineArgs, stream_outputs: bool = False) -> LLMEngine:
        """`stream_outputs`: the core's `update` also returns each unfinished request's new tokens
        (`AsyncLLM`); the offline path pays for finished outputs only."""
        args.validate()
        if args.tensor_parallel_size > 1 and args.distributed_executor_backend != "external_launcher":
            check_not_bootstrapping()
        if args.seed is not None:
            torch.manual_seed(args.seed)
        device = _device(args.device)
        if args.kv_cache_dtype != "auto" and device.type != "cpu":
            raise NotImplementedError(
                f"`kv_cache_dtype={args.kv_cache_dtype!r}` runs on the CPU only: ferrollm's Triton attention "
                "kernels read and write the model's dtype. Use kv_cache_dtype='auto' on a GPU.")
        clock = StartupClock()
        with clock.phase("importing transformers"):
            # `from ferrollm import LLM` imports torch but not transformers; the first engine pays
            # for it (~0.5 s here).
            import transformers.configuration_utils  # noqa: F401
        with clock.phase("config"):
            source = resolve_model_source(args.model, args.revision, args.download_dir, args.hf_token)
            hf_config, weights = _read_checkpoint(source, args.use_tqdm_on_load)
            if args.load_format == "dummy":
                check_dummy_source(hf_config, source.is_gguf)
            model_config = build_model_config(
                source, hf_config, hf_overrides=args.hf_overrides, dtype=args.dtype,
                max_model_len=args.max_model_len, device=device, runner=args.runner, convert=args.convert,
                pooler_config=args.pooler_config, quantization=args.quantization,
            )
        with clock.phase("tokenizer"):
            tokenizers = (Tokenizers(None) if args.skip_tokenizer_init
                          else load_tokenizers(source, args.tokenizer, args.revision, args.tokenizer_mode))
            mm_processor = build_mm_processor(args, model_config)
        if model_config.is_pooling:
            if args.logits_processors:
                raise ConfigError(f"{STR_POOLING_REJECTS_LOGITSPROCS} `logits_processors` must be empty for "
                                  f"{model_config.architecture} (runner='pooling'). Given: {args.logits_processors!r}")
            if args.tensor_parallel_size > 1:
                raise ConfigError("`tensor_parallel_size` must be 1 for a pooling model (runner='pooling'). "
                                  f"Given: {args.tensor_parallel_size}")
            from ferrollm.model_executor.loader import get_model

            with clock.phase("weights"):
                stream = dummy_weights(model_config.hf_config) if args.load_format == "dummy" else weights()
                model = get_model(model_config.hf_config, model_config.dtype, stream, device=device,
                                  quant_config=model_config.quant_config)
            core, runner = build_pooling_core(args, model_config, model, tokenizers, device)
            clock.log()
            return cls(args, model_config, tokenizers, core, runner)
        # vLLM's encoder budget: a step's worth of tokens, but never less than the largest item
        # (no item outgrows a prompt: a long video's bound is max_model_len).
        per_item = mm_processor.max_tokens_per_item() if mm_processor is not None else 0
        per_item = min(per_item, model_config.max_model_len)
        engine = cls._from_workers(args, model_config, tokenizers, device, clock, per_item, stream_outputs)
        engine.mm_processor = mm_processor
        clock.log()
        return engine

    @classmethod
    def _from_workers(cls, args: EngineArgs, mc: ModelConfig, tokenizers: Tokenizers, device: torch.device,
                      clock: StartupClock, tokens_per_mm_item: int = 0, stream_outputs: bool = False) -> LLMEngine:
        """A generative engine: every rank loads its shard and states how many KV blocks it can
        hold; the core gets the smallest number, and every rank allocates that many."""
        batched = batched_tokens(args, mc.max_model_len)
        check_whole_mm_items(args, mc, batched, tokens_per_mm_item)
        # The decode sizes every GPU rank captures as CUDA graphs (vLLM's defaults capped by
        # max_num_seqs); none with enforce_eager or on the CPU.
        compilation = CompilationConfig.from_value(args.compilation_config)
        compilation.init_capture_sizes(args.max_num_seqs, batched,
                                       enforce_eager=args.enforce_eager or device.type != "cuda")
        options = CacheOptions(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                               max_num_batched_tokens=batched, gpu_memory_utilization=args.gpu_memory_utilization,
                               load_format=args.load_format, use_tqdm_on_load=args.use_tqdm_on_load,
                               compilation_config=compilation, num_gpu_blocks_override=args.num_gpu_blocks_override,
                               kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
                               encoder_budget=max(batched, tokens_per_mm_item) if tokens_per_mm_item else 0,
                               tokens_per_mm_item=tokens_per_mm_item)
        executor: MultiprocExecutor | ExternalLauncherExecutor | None = None
        if args.tensor_parallel_size > 1:
            check_tp_shapes(mc.hf_config, args.tensor_parallel_size)
        if args.distributed_executor_backend == "external_launcher":
            executor = ExternalLauncherExecutor(mc, options, device, args.tensor_parallel_size)
            driver, run = executor.driver_worker, executor.collective_rpc
        elif args.tensor_parallel_size > 1:
            executor = MultiprocExecutor(mc, options, device, args.tensor_parallel_size)
            driver, run = executor.driver_worker, executor.collective_rpc
        else:
            driver = Worker(mc, options, 0, 1, device)

            def run(method: str, *a: Any) -> list[Any]:
                return [getattr(driver, method)(*a)]
        try:
            start = time.perf_counter()
            with clock.phase("weights"):
                num_blocks = min(run("load_model"))
            load_seconds = time.perf_counter() - start
            with clock.phase("KV cache"):
                core = build_core(args, mc, driver.sliding_window(), num_blocks, tokenizers, options.encoder_budget,
                                  stream_outputs)
                run("init_kv_cache", num_blocks, tokenizers.eos_token_ids)
        except BaseException:
            if executor is not None:
                executor.shutdown(graceful=False)
            raise
        if isinstance(executor, MultiprocExecutor):
            core.set_step_broadcaster(executor.broadcaster)
        assert driver.runner is not None
        engine = cls(args, mc, tokenizers, core, driver.runner, executor)
        engine.model_load_seconds = load_seconds
        engine.num_gpu_blocks = num_blocks
        # Rank 0's GPU start-up measurements (None on the CPU), for logs and tests.
        engine.memory_profile = driver.memory_profile
        _log_memory(args, mc, driver.runner, num_blocks, driver.kv_cache_sizing)
        return engine

    @property
    def vllm_config(self) -> VllmConfig:
        """The resolved configuration under vLLM's names (a read-out, see config/vllm.py)."""
        return build_vllm_config(self.args, self.model_config, self.num_gpu_blocks,
                                 batched_tokens(self.args, self.model_config.max_model_len))

    def get_num_unfinished_requests(self) -> int:
        """Requests (each of a prompt's `n` sequences counts) waiting or running."""
        s = self.core.stats()
        return int(s["num_running"]) + int(s["num_waiting"])

    @property
    def generation_runner(self) -> ModelRunner:
        """The runner of a generative model."""
        if not isinstance(self.runner, ModelRunner):
            raise EngineError("this engine runs a pooling model, which has no sampling runner")
        return self.runner

    @property
    def pooling_runner(self) -> PoolingModelRunner:
        """The runner of a pooling model."""
        if not isinstance(self.runner, PoolingModelRunner):
            raise EngineError("this engine runs a generative model, which has no pooling runner")
        return self.runner

    @property
    def vocab_size(self) -> int:
        return int(text_config_of(self.model_config.hf_config).vocab_size)

    def add_requests(self, request_ids: list[str], prompts: Sequence[str | list[int]],
                     params: list[SamplingParams], add_special_tokens: bool = True,
                     priorities: list[int] | None = None,
                     mm_inputs: Sequence[MultiModalInputs | None] | None = None) -> None:
        """Queues requests atomically: either all are accepted or none is. A request with
        `mm_inputs` has its prompt replaced by their expanded token ids; their items' content
        hashes enter its prefix-cache block hashes."""
        self.check_alive()
        for p in params:
            validate_request(self.args.logits_processor_classes, p)
            p.verify_logprobs(self.args.max_logprobs, self.vocab_size)
            p.update_from_tokenizer(self.tokenizers.core)
            p.verify_token_ids(self.vocab_size)
        mm = list(mm_inputs) if mm_inputs is not None else [None] * len(request_ids)
        prompts = [m.prompt_token_ids if m is not None else p for p, m in zip(prompts, mm)]
        prompts = self._encoded(prompts, add_special_tokens)
        features = [m.core_features() if m is not None else [] for m in mm]
        self.core.add_requests(request_ids, list(prompts), [p.to_core() for p in params],
                               priorities=priorities, add_special_tokens=add_special_tokens,
                               mm_features=features if any(features) else None)
        if self.stats is not None:
            self.stats.on_add(request_ids)
        for rid, p, m in zip(request_ids, params, mm):
            self.generation_runner.add_request_params(rid, p, m)

    def _encoded(self, prompts: Sequence[str | list[int]], add_special_tokens: bool) -> list[str | list[int]]:
        """Text prompts stay text for the core to encode in parallel, unless the tokenizer mode
        encodes in Python ("slow") or there is no tokenizer (`skip_tokenizer_init`)."""
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts or not (self.tokenizers.encode_in_python or self.tokenizers.core is None):
            return list(prompts)
        if self.tokenizers.core is None:
            raise InvalidRequestError(f"{SKIPPED}: prompt {texts[0]} is text; pass "
                                      "{'prompt_token_ids': [...]} (a TokensPrompt) instead")
        out = list(prompts)
        for i, ids in zip(texts, self.tokenizers.encode_batch([prompts[i] for i in texts], add_special_tokens)):
            out[i] = ids
        return out

    def add_pooling_requests(self, request_ids: list[str], prompts: list[list[int]],
                             params: list[PoolingParams]) -> None:
        """Queues tokenized pooling requests atomically; each ends after its prompt's step."""
        # detokenize=False: the placeholder token is never shown; ignore_eos: it ends on length.
        one_step = SamplingOptions(max_tokens=1, detokenize=False, ignore_eos=True, temperature=0.0)
        self.core.add_requests(request_ids, list(prompts), [one_step] * len(prompts), add_special_tokens=False)
        for rid, p in zip(request_ids, params):
            self.pooling_runner.add_request_params(rid, p)

    def has_unfinished_requests(self) -> bool:
        # An update in flight may still hold final outputs the core no longer counts.
        return (self._pending is not None and self._pending.busy()) or self.core.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """One schedule -> execute -> update; returns the requests that finished.

        With `async_scheduling`, the update runs on a thread while the caller handles what this
        call returns: the outputs of the previous step's update (the same outputs, one call later).

        Raises:
            WorkerError: a tensor-parallel worker raised or died (its traceback included); the
                engine is dead afterwards (`EngineDeadError` on later calls).
        """
        if self._pending is None:
            return self.core.update(self._execute_step())
        previous = self._pending.collect()
        if isinstance(self.runner, ModelRunner):
            # The next step reuses finished requests' indices: keep their states for the caller.
            for out in previous:
                if out.finished:
                    self.runner.hold(out.request_id)
        if not self.core.has_unfinished_requests():
            return previous
        try:
            sampled = self._execute_step()
        except BaseException:
            # Everything was aborted and the error goes to the caller: drop the held states.
            for out in previous:
                self.runner.release(out.request_id)
            raise
        self._pending.start(self.core.update, sampled)
        return previous

    def _execute_step(self) -> Any:
        """Schedules a step and runs it; returns its sampled tokens."""
        if not isinstance(self.executor, MultiprocExecutor):
            step = self.core.schedule()
            try:
                sampled = self.runner.execute_model(step)
                if self.executor is not None:  # external launcher: every core takes rank 0's draw
                    sampled = self.executor.sync_sampled(sampled)
            except BaseException:
                self.abort_all()
                raise
        else:
            executor = self.executor
            executor.check_alive()
            try:
                # Publishes the step to the other ranks before rank 0 runs it.
                step = self.core.schedule()
                sampled = self.runner.execute_model(step)
            except BaseException as e:
                # The ranks are out of step (or dead): no further step can be broadcast.
                self.core.set_step_broadcaster(None)
                self.abort_all()
                executor._raise_failure(e)
        if self.stats is not None:
            self.stats.on_step(step, self.core)
        return sampled

    def check_alive(self) -> None:
        """Raises `EngineDeadError` when a tensor-parallel rank failed earlier."""
        if self.executor is not None:
            self.executor.check_alive()

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        """Every rank writes its own parameters to ``path`` (see `LLM.save_sharded_state`)."""
        if self.executor is not None:
            self.executor.collective_rpc("save_sharded_state", path, pattern, max_size)
            return
        from ferrollm.model_executor.sharded_state import save_rank_state

        save_rank_state(self.generation_runner.model, path, 0, pattern, max_size)

    def abort_all(self) -> None:
        """Aborts everything after a failed or interrupted step and clears the runner's state,
        so the next call starts clean."""
        in_flight = self._pending.drain() if self._pending is not None else []
        self.core.abort_all_requests()
        step = self.core.schedule()
        self.runner.update_states(step)
        for out in in_flight + self.core.update(np.zeros(0, dtype=np.int64)):
            self.runner.release(out.request_id)
        if self.stats is not None:
            self.stats.requests.clear()

    def close(self) -> None:
        if self._pending is not None:
            self._pending.close()
        if self.executor is not None:
            self.core.set_step_broadcaster(None)
            self.executor.shutdown()
        self.runner.kv_caches.clear()
        if isinstance(self.runner, ModelRunner):
            # The graphs hold the cache's and their pool's memory until they are dropped.
            self.runner.cuda_graphs = None
        self.tokenizers.close()


def _read_checkpoint(source, progress: bool = False):
    """The HF config and a factory for the weight iterator."""
    from ferrollm.model_executor import loader

    if source.gguf_file is not None:
        # The file is parsed once per process (`gguf_reader.open_gguf`), so the factory's second
        # `load_gguf` only builds a fresh iterator.
        config, _ = loader.load_gguf(source.gguf_file)
        return config, lambda: loader.load_gguf(source.gguf_file)[1]
    from ferrollm.config.remote_configs import load_hf_config

    # AutoConfig, or ferrollm's own build of a remote-code config (InternLM2, InternVLChatModel).
    config = load_hf_config(source.folder)
    return config, lambda: loader.iterate_safetensors(source.folder, progress=progress)


def _log_memory(args: EngineArgs, mc: ModelConfig, runner: ModelRunner, num_blocks: int, sizing: str) -> None:
    """Rank 0's weights, KV cache and largest step workspace, at INFO."""
    batched = batched_tokens(args, mc.max_model_len)
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    workspace = activation_workspace_bytes(text_config_of(mc.hf_config), mc.dtype, batched, args.max_num_seqs)
    kv = KVCacheSummary(kv_bytes, num_blocks, args.block_size, str(runner.kv_caches[0].dtype).removeprefix("torch."),
                        sizing)
    log_memory(model_weight_bytes(runner.model), kv, workspace, batched, args.max_num_seqs)
