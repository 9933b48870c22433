"""`LLM`: vLLM's offline inference API.

    from ferrollm import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint")
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))

Embedding models (``runner="pooling"``) use `encode`, `embed` and `score` (entrypoints/pooling.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ferrollm.engine.arg_utils import EngineArgs, check_known_names
from ferrollm.engine.llm_engine import LLMEngine
from ferrollm.entrypoints.output_builder import LogprobDecoder, PendingRequest, completion, prompt_logprobs
from ferrollm.entrypoints.pooling import PoolingMixin
from ferrollm.entrypoints.prompts import multimodal_fields, normalize_prompts
from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.multimodal.chat import extract_images, processor_chat_template
from ferrollm.multimodal.content_format import join_parts, resolve_content_format
from ferrollm.multimodal.requests import process_multimodal
from ferrollm.outputs import RequestOutput
from ferrollm.beam_search import BeamSearchOutput
from ferrollm.sampling_params import BeamSearchParams, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM(PoolingMixin):
    """An LLM for offline inference, with vLLM's arguments and defaults.

    Every keyword of vLLM 0.32's `EngineArgs` is accepted (`ferrollm.engine.arg_list` lists
    them with what ferrollm does with each; the README has the table). Those ferrollm does not
    implement are accepted at vLLM's default and raise `UnsupportedOptionError` (a ValueError
    and a NotImplementedError) otherwise; a keyword vLLM does not know is a TypeError. The ones
    that work:

    Args:
        model: a local checkpoint folder, a `.gguf` file, or a hub id (from the local Hugging
            Face cache, or fetched unless `HF_HUB_OFFLINE` is set).
        tokenizer: a tokenizer folder or hub id; defaults to the model's own.
        dtype: "auto", "float32", "bfloat16" or "float16". On the CPU "auto" keeps a bf16 (or
            fp16) checkpoint in bf16 and runs an fp32 one in fp32, or in bf16 where the CPU has
            native bf16 dot products (AVX512-BF16, AMX); the start-up log says which and why.
        seed: seeds the global random state used by requests without their own seed.
        max_model_len: the longest prompt + output; defaults to the model's maximum.
        max_num_seqs: requests running at once.
        max_num_batched_tokens: tokens per step (decodes and prefill chunks share it).
        block_size: tokens per KV block.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes.
        hf_overrides: a dict merged into the model's config, or a callable that edits it.
        device: "auto", "cpu" or "cuda".
        gpu_memory_utilization: fraction of GPU memory the engine may take (GPU only).
        enforce_eager: never capture CUDA graphs (GPU only). By default a GPU engine captures its
            decode steps at `compilation_config`'s sizes and pads each decode batch to the next one.
        compilation_config: a `CompilationConfig`, a dict of its fields or an int level, as vLLM
            takes it: the CUDA-graph capture sizes and, on a GPU, the torch.compile level
            (default NO_COMPILATION; PIECEWISE cuts the graph at attention).
        quantization: the weights' quantization method. None reads it from the checkpoint
            (``quantization_config`` in config.json: compressed-tensors, gptq, awq, fp8; or a
            GGUF file). Naming the checkpoint's own method is accepted (``gptq_marlin`` and
            ``awq_marlin`` too); on a float checkpoint "fp8" (vLLM's dynamic FP8), "int8"
            (dynamic W8A8) and "rtn" (int8/int4 weight-only, `RTN_NUM_BITS`,
            `RTN_GROUP_SIZE`) quantize the weights as they load.
        tensor_parallel_size: ranks to shard the model over. Ranks beyond the first run in
            spawned processes on this machine (GPU i of CUDA_VISIBLE_DEVICES for rank i, or an
            even share of the CPU cores each); build the LLM under ``if __name__ == "__main__":``.
        distributed_executor_backend: "mp" (the default) or None; "ray" is not supported.
        load_format: "auto", "safetensors", "gguf", or "sharded_state" for a folder written by
            `save_sharded_state` at the same tensor_parallel_size.
        runner: "auto", "generate" or "pooling". "auto" pools for encoder-only models (BERT),
            for convert="embed" and for checkpoints with a sentence-transformers pooling config,
            and generates otherwise.
        convert: "auto", "none" or "embed": "embed" runs a generative checkpoint as an
            embedding model (last-token pooling, normalized, unless its config says otherwise).
        pooler_config: a `PoolerConfig` or dict (``pooling_type``, ``normalize``) overriding
            the pooling model's defaults.
        generation_config: "auto" takes default sampling parameters from the model's
            generation_config.json when `generate` gets none; "vllm" ignores the file; a folder
            path reads the file there.
        override_generation_config: fields merged over the generation config.
        limit_mm_per_prompt: items per modality a prompt may carry, e.g. ``{"image": 2,
            "video": 1}`` (default 999); 0 refuses the modality, and 0 for all the model takes
            skips loading the vision tower.
        mm_processor_kwargs: options for the checkpoint's image (and video) processor (e.g.
            ``max_pixels``, ``min_pixels``, ``fps`` for Qwen2-VL); a prompt's own
            ``mm_processor_kwargs`` override them.
        mm_processor_cache_gb: GiB of processed images and videos kept by content hash (default
            ``FERROLLM_MM_INPUT_CACHE_GIB`` or ``VLLM_MM_INPUT_CACHE_GIB``, else 4; 0 disables).
        max_logprobs: the most `logprobs` / `prompt_logprobs` a request may ask for (-1: no
            limit); more raises a `ValueError` with vLLM's wording.
        logprobs_mode: what logprobs hold: "raw_logprobs" (default), "raw_logits",
            "processed_logprobs" or "processed_logits" (after penalties, masks, temperature and
            the top-k / top-p / min-p filters).
        logits_processors: custom batch-level logits processors, vLLM v1's `LogitsProcessor`
            subclasses or their qualified names ("module:Class" or "module.Class"), built once
            on rank 0 and switched per request through `SamplingParams.extra_args`.
        num_gpu_blocks_override: the KV cache's block count (the null block included), replacing
            the memory-based sizing on the CPU too.
        kv_cache_memory_bytes: the KV cache's bytes, replacing `gpu_memory_utilization`'s sizing
            on a GPU and FERROLLM_CPU_KVCACHE_SPACE on the CPU.
        kv_cache_dtype: "auto" (the model's dtype), "fp8"/"fp8_e4m3" or "fp8_e5m2".
        enable_chunked_prefill: split prompts across steps (default True). False prefills each
            prompt in one step; `max_num_batched_tokens` then defaults to at least
            `max_model_len`, and a smaller value is refused.
        long_prefill_token_threshold: most tokens one request takes per step while others are
            live (0: no cap).
        scheduling_policy: "fcfs" or "priority" (lowest `priority` value first, then arrival;
            the running request with the largest is preempted first).
        async_scheduling: True runs each step's core update (detokenization, stop checks) on a
            thread beside the caller's handling of the previous step's outputs; outputs are
            identical. The next step is still scheduled after the update (no placeholders).
            None stays off (vLLM turns it on for generative models): it buys nothing
            measurable on the CPU, where the model run is >99% of a step. Pooling models take
            True too, as in vLLM.
        chat_template: the Jinja template (or a file holding it) `chat` uses by default.
    """

    def __init__(self, model: str, *, chat_template: str | None = None, **kwargs: Any) -> None:
        # As in vLLM, an offline LLM keeps quiet unless asked for statistics.
        kwargs.setdefault("disable_log_stats", True)
        check_known_names(kwargs)
        args = EngineArgs(model=str(model), **kwargs)
        self.chat_template = _load_chat_template(chat_template)
        self.llm_engine: LLMEngine | None = LLMEngine.from_args(args)
        # vLLM's `llm.model_config` (hf_config, max_model_len, get_vocab_size(), ...).
        self.model_config = self.llm_engine.model_config
        self._request_counter = itertools.count()
        tokenizers = self.llm_engine.tokenizers
        self._decoder = LogprobDecoder(tokenizers.core, lambda: tokenizers.hf)

    # -- lifecycle ---------------------------------------------------------------------------

    def close(self) -> None:
        """Releases the model, the KV cache and temporary files. Safe to call twice."""
        if self.llm_engine is not None:
            self.llm_engine.close()
            self.llm_engine = None

    def save_sharded_state(self, path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        """Saves the model as per-rank files that ``load_format="sharded_state"`` loads back
        at the same `tensor_parallel_size`, each rank reading only its own files.

        Every rank writes ``model-rank-{rank}-part-{part}.safetensors`` (its parameters, already
        sharded); the checkpoint's other files (config, tokenizer, generation config...) are
        copied alongside, so ``path`` can be passed as `model`.

        Args:
            path: the output folder (created if needed).
            pattern: file name with ``{rank}`` and ``{part}`` fields.
            max_size: the largest file in bytes before a new part starts (None: one per rank).
        """
        from ferrollm.model_executor.sharded_state import copy_non_weight_files

        engine = self._engine()
        engine.check_alive()
        engine.save_sharded_state(str(path), pattern, max_size)
        source = engine.model_config.source
        if source.folder is not None and not source.is_gguf:
            copy_non_weight_files(source.folder, path)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _engine(self) -> LLMEngine:
        if self.llm_engine is None:
            raise RuntimeError("this LLM has been closed")
        return self.llm_engine

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer."""
        return self._engine().tokenizers.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters `generate` uses when given none: the model's generation_config.json
        fields (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
        max_tokens) over vLLM's defaults, unless the LLM was built with generation_config="vllm".

        Returns:
            A new `SamplingParams`.
        """
        return SamplingParams(**self._engine().default_sampling_fields)

    # -- generation --------------------------------------------------------------------------

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generates completions for the prompts, in input order.

        Args:
            prompts: a string, a `{"prompt": ...}` or `{"prompt_token_ids": [...]}` dict, or a
                list of these. A dict may carry ``multi_modal_data`` (``{"image": PIL image
                or list}``, one placeholder per image in the prompt) and its own
                ``mm_processor_kwargs``.
            sampling_params: one for all prompts, one per prompt, or None for the defaults.
            use_tqdm: show a progress bar.
            priority: one value for every prompt or one per prompt; lower runs first under
                ``scheduling_policy="priority"`` (accepted and unused under "fcfs", as in vLLM).

        Returns:
            One `RequestOutput` per prompt.
        """
        return self._generate(prompts, sampling_params, use_tqdm, priority, add_special_tokens=True)

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        priority: int | Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Renders each conversation with the tokenizer's chat template and generates a reply.

        Args:
            messages: one conversation (a list of `{"role", "content"}` dicts) or a list of them.
                Content may be a list of parts: ``{"type": "text"}``, ``{"type": "image_url",
                "image_url": {"url": data: URL or local path}}``, ``{"type": "image_pil"}``.
            sampling_params: as in `generate`.
            chat_template: a Jinja template to use instead of the tokenizer's.
            chat_template_content_format: "auto" (read from the template), "string" (each
                message's parts joined into one string, the model's placeholder per image
                first: InternVL2's template takes that) or "openai" (the parts as a list).
            add_generation_prompt: end the prompt with the assistant's turn header.
            continue_final_message: continue the last (assistant) message instead.
            chat_template_kwargs: extra variables for the template.
            priority: as in `generate`, one value or one per conversation.

        Returns:
            One `RequestOutput` per conversation.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        chat_template = chat_template if chat_template is not None else self.chat_template
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            chat_template = processor_chat_template(self._engine().model_config.source.folder)
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise InvalidRequestError("`chat_template` must be given: the tokenizer has no chat template")
        content_format = resolve_content_format(chat_template_content_format, chat_template or tok.chat_template)
        mm_processor = self._engine().mm_processor
        placeholders = mm_processor.placeholders if mm_processor is not None else {}
        prompts: list[Any] = []
        for conv in conversations:
            # `image_url`/`image_pil` parts become the template's image parts plus multi_modal_data.
            conv, images = extract_images(conv)
            if content_format == "string":
                conv = join_parts(conv, placeholders)
            text = tok.apply_chat_template(
                conv, tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        # The template already holds the special tokens (BOS and the like), as in vLLM.
        return self._generate(prompts, sampling_params, use_tqdm, priority, add_special_tokens=False)

    def beam_search(self, prompts: Any, params: BeamSearchParams, lora_request: Any = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """Generates with beam search, as vLLM's `LLM.beam_search` (entrypoints/beam_search.py).

        Args:
            prompts: Strings, `{"prompt": ...}` or `{"prompt_token_ids": [...]}` dicts.
            params: The `BeamSearchParams`; `2 * beam_width` must not exceed `max_logprobs`.
            lora_request: Must be None (no LoRA support).
            use_tqdm: Show a progress bar over token steps.
            concurrency_limit: Most prompts searched at once (None: all).

        Returns:
            One `BeamSearchOutput` per prompt: its best `beam_width` sequences, best first.
        """
        from ferrollm.entrypoints.beam_search import beam_search

        if lora_request is not None:
            raise NotImplementedError(f"`lora_request` must be None: ferrollm has no LoRA support. Given: {lora_request!r}")
        return beam_search(self, prompts, params, use_tqdm, concurrency_limit)

    def _generate(self, prompts, sampling_params, use_tqdm, priority, add_special_tokens) -> list[RequestOutput]:
        engine = self._engine()
        if engine.model_config.is_pooling:
            raise InvalidRequestError(_not_generative(engine))
        items = normalize_prompts(prompts, engine.vocab_size)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = _expand_params(sampling_params, len(items))
        priority = _priority_per_prompt(priority, len(items))
        mm = process_multimodal(engine, items, multimodal_fields(prompts), add_special_tokens)
        pending, ids, seq_prompts, seq_params, seq_prio, seq_mm = [], [], [], [], [], []
        for i, ((text, prompt), p) in enumerate(zip(items, params)):
            rid = str(next(self._request_counter))
            pending.append(PendingRequest(rid, text, p.n))
            for k, child in enumerate(_fan_out(p)):
                ids.append(rid if p.n == 1 else f"{k}_{rid}")
                seq_prompts.append(prompt)
                seq_params.append(child)
                seq_prio.append(priority[i])
                seq_mm.append(mm[i])
        engine.add_requests(ids, seq_prompts, seq_params, add_special_tokens, seq_prio,
                            mm_inputs=seq_mm if any(m is not None for m in seq_mm) else None)
        return self._run(engine, pending, use_tqdm)

    def _run(self, engine: LLMEngine, pending: list[PendingRequest], use_tqdm: bool) -> list[RequestOutput]:
        by_id = {p.request_id: p for p in pending}
        bar = _progress(len(pending), use_tqdm)
        start, num_in, num_out = time.perf_counter(), 0, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                k, parent = _parent_of(out.request_id, by_id)
                state = engine.generation_runner.release(out.request_id)
                if engine.stats is not None and (stats := engine.stats.pop(out.request_id)) is not None:
                    parent.metrics.append(stats)
                parent.completions[k] = completion(k, out, state, self._decoder)
                if parent.prompt_token_ids is None:
                    parent.prompt_token_ids = list(out.prompt_token_ids)
                    parent.prompt_logprobs = prompt_logprobs(state, self._decoder)
                    parent.num_cached_tokens = out.num_cached_tokens
                num_out += len(out.token_ids)
                if parent.done and bar is not None:
                    num_in += len(parent.prompt_token_ids)
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"est. speed input: {num_in / elapsed:.2f} toks/s, output: {num_out / elapsed:.2f} toks/s")
                    bar.update(1)
        if bar is not None:
            bar.close()
        return [p.to_output() for p in pending]


def _load_chat_template(template: str | None) -> str | None:
    """A template given as a file path is read from the file, as in vLLM."""
    if template is None or "{" in template:
        return template
    path = Path(template)
    if path.is_file():
        return path.read_text()
    raise ConfigError(f"`chat_template` must be a Jinja template or a file holding one. Given: {template!r} "
                      "(no such file, and no Jinja syntax)")


def _not_generative(engine: LLMEngine) -> str:
    mc = engine.model_config
    if mc.convert_type == "embed":
        how = "Build the LLM without runner='pooling'/convert='embed' to generate text."
    else:
        how = f"{mc.architecture} is an encoder-only model and cannot generate text."
    return (f"LLM.generate() needs a generative model, but this LLM runs {mc.architecture} as a pooling "
            f"model (runner='pooling'); use LLM.embed(), LLM.encode() or LLM.score(). {how}")


def _expand_params(sampling_params, n: int) -> list[SamplingParams]:
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n:
        raise InvalidRequestError(f"`sampling_params` must be one per prompt ({n}) or a single one. Given: {len(params)}")
    return params


def _priority_per_prompt(priority, n: int) -> list[int]:
    """vLLM's forms: None (0 for all), one int for all, or one per prompt."""
    if priority is None:
        return [0] * n
    if not isinstance(priority, Sequence):
        return [int(priority)] * n
    values = list(priority)
    if len(values) != n:
        raise InvalidRequestError(f"The lengths of prompts ({n}) and priority ({len(values)}) must be the same.")
    return [int(v) for v in values]


def _fan_out(p: SamplingParams) -> list[SamplingParams]:
    """`n` independent sequences; a seeded request's child i uses seed + i."""
    if p.n == 1:
        return [p]
    children = []
    for i in range(p.n):
        child = p.clone()
        child.n = 1
        if p.seed is not None:
            child.seed = p.seed + i
        children.append(child)
    return children


def _parent_of(seq_id: str, by_id: dict[str, PendingRequest]) -> tuple[int, PendingRequest]:
    if seq_id in by_id:
        return 0, by_id[seq_id]
    k, _, rid = seq_id.partition("_")
    return int(k), by_id[rid]


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
