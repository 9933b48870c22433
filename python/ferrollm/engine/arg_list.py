"""Every option of vLLM 0.32's `EngineArgs`, with vLLM's default, grouped as vLLM groups its
configs, and what ferrollm does with it: works (and where), or refused (and why).

This list is the single source of the `EngineArgs` fields (`engine/arg_utils.py`), of the check
that refuses a non-default value of an option ferrollm does not implement, and of the README's
compatibility table (`tools/compat_table.py`). `tools/vllm_engine_args.py` compares it with a vLLM
source tree when vLLM's release changes.

A refused option is accepted at vLLM's default (so scripts that spell defaults out still run);
any other value raises `UnsupportedOptionError` naming the option, the value and the reason. No
value is ever silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.32.0"

# The default of an option whose vLLM default is a default-constructed config object
# (`CompilationConfig()`, ...): None or an empty dict stand for it.
DEFAULT_CONFIG = "<default config>"



@dataclass(frozen=True)
class EngineArg:
    """One option.

    Attributes:
        name: the keyword, as in vLLM.
        group: vLLM's config group (`ModelConfig`, `CacheConfig`, ...), or "ferrollm" for
            ferrollm's own additions.
        default: vLLM's default (`DEFAULT_CONFIG` for a default-constructed config object).
        works: where ferrollm implements it; None when refused.
        refused: why a non-default value is refused (the group's reason when the entry has none).
    """

    name: str
    group: str
    default: Any
    works: str | None
    refused: str | None


def _works(where: str) -> tuple[str, None]:
    return where, None


def _refused(why: str | None = None) -> tuple[None, str | None]:
    return None, why


# Group -> why its refused options are refused, unless an entry says otherwise.
GROUP_REASONS: dict[str, str] = {
    "ModelConfig": "not supported by ferrollm",
    "LoadConfig": "ferrollm loads safetensors and GGUF files with its own loader",
    "AttentionConfig": "ferrollm chooses its own attention kernels (CPU or Triton)",
    "MambaConfig": "no Mamba/SSM models in ferrollm",
    "StructuredOutputsConfig": "structured outputs (guided decoding) are not supported",
    "ParallelConfig": "ferrollm runs tensor parallelism on one machine only: no pipeline, data, "
                      "expert or context parallelism, no multi-node and no Ray",
    "CacheConfig": "not supported by ferrollm's paged KV cache",
    "OffloadConfig": "weight offloading to CPU memory is not supported",
    "MultiModalConfig": "not supported by ferrollm's multimodal path (images and video frames for Qwen2-VL and Qwen2.5-VL; images for Gemma 3, InternVL, InternVL2 and Fuyu)",
    "LoRAConfig": "LoRA adapters are not supported",
    "LoggingConfig": "ferrollm logs through the standard `logging` module (logger 'ferrollm'); "
                     "configure it there",
    "ObservabilityConfig": "ferrollm exports no metrics or traces",
    "SchedulerConfig": "not supported by ferrollm's scheduler",
    "CompilationConfig": "",
    "KernelConfig": "ferrollm chooses its own kernels",
    "VllmConfig": "not supported by ferrollm",
    "ferrollm": "",
}

_W_ENGINE = "engine/llm_engine.py"
_W_MODEL = "config/model_config.py"

# (group, [(name, vLLM default, (works, refused))]) in vLLM's grouping.
_TABLE: list[tuple[str, list[tuple[str, Any, tuple[str | None, str | None]]]]] = [
    ("ModelConfig", [
        ("model", "Qwen/Qwen3-0.6B", _works("config/model_source.py: a folder, a .gguf file or a hub id")),
        ("enable_return_routed_experts", False, _refused("no MoE routing outputs")),
        ("return_sampling_mask", False, _refused()),
        ("model_weights", "", _refused("weights come from `model`'s folder or file")),
        ("served_model_name", None, _refused("only names the model in vLLM's OpenAI server")),
        ("tokenizer", None, _works("engine/tokenizer_loader.py")),
        ("hf_config_path", None, _refused("the config is read from `model`; use `hf_overrides`")),
        ("runner", "auto", _works(_W_MODEL)),
        ("convert", "auto", _works(_W_MODEL)),
        ("skip_tokenizer_init", False, _works("engine/tokenizer_loader.py: token ids in, token ids out")),
        ("enable_prompt_embeds", False, _refused("prompt embeddings as input are not supported")),
        ("tokenizer_mode", "auto", _works("engine/tokenizer_loader.py: 'auto', 'hf', 'slow'")),
        ("trust_remote_code", False, _works("accepted: ferrollm runs its own implementation of "
                                           "each architecture, never the checkpoint's code")),
        ("allowed_local_media_path", "", _refused("`LLM.chat` reads local image paths and data: URLs as given; no media allow-list")),
        ("allowed_media_domains", None, _refused("images are not fetched over the network")),
        ("config_format", "auto", _refused("only Hugging Face config.json (and GGUF metadata) is read")),
        ("dtype", "auto", _works(_W_MODEL)),
        ("seed", 0, _works(_W_ENGINE + " (seeds torch's global generator)")),
        ("max_model_len", None, _works(_W_MODEL)),
        ("disable_sliding_window", False, _refused("sliding-window models always run with their window")),
        ("disable_cascade_attn", None, _works("accepted: ferrollm has no cascade attention")),
        ("max_logprobs", 20, _works("per request, in `LLMEngine.add_requests`")),
        ("logprobs_mode", "raw_logprobs", _works("`model_executor/sampler.py`")),
        ("use_fp64_gumbel", False, _refused()),
        ("enable_trace_replay", False, _refused()),
        ("revision", None, _works("config/model_source.py (hub ids)")),
        ("code_revision", None, _refused("no remote code is run")),
        ("hf_token", None, _works("config/model_source.py: the token hub ids are fetched with")),
        ("hf_overrides", {}, _works(_W_MODEL)),
        ("model_class_overrides", {}, _refused("use `hf_overrides={'architectures': [...]}`")),
        ("tokenizer_revision", None, _refused()),
        ("quantization", None, _works("model_executor/layers/quantization")),
        ("quantization_config", None, _refused("the method comes from `quantization` or the checkpoint")),
        ("allow_deprecated_quantization", False, _works("accepted: no method is deprecated here")),
        ("enforce_eager", False, _works("worker/cuda_graph.py")),
        ("io_processor_plugin", None, _refused("no plugins")),
        ("renderer_num_workers", 1, _refused()),
        ("pooler_config", None, _works("config/pooler_config.py")),
        ("generation_config", "auto", _works("config/generation_config.py")),
        ("enable_sleep_mode", False, _refused("sleep mode is not built")),
        ("sleep_mode_offload_cudagraph", False, _refused("sleep mode is not built")),
        ("sleep_preserve_parameter_names", [], _refused("sleep mode is not built")),
        ("enable_cumem_allocator", False, _refused("sleep mode is not built")),
        ("enable_nccl_comm_suspend", False, _refused("sleep mode is not built")),
        ("override_generation_config", {}, _works("config/generation_config.py")),
        ("model_impl", "auto", _refused("ferrollm runs its own model implementations only")),
        ("logits_processors", None, _works("`worker/logits_processors.py`, vLLM v1's interface")),
    ]),
    ("LoadConfig", [
        ("download_dir", None, _works("config/model_source.py: the hub cache a hub id is found or fetched in")),
        ("safetensors_load_strategy", None, _refused()),
        ("safetensors_prefetch_num_threads", 8, _refused()),
        ("safetensors_prefetch_block_size", 16 * 1024 * 1024, _refused()),
        ("load_format", "auto", _works("model_executor/loader.py; 'dummy': model_executor/dummy_weights.py")),
        ("model_loader_extra_config", {}, _refused()),
        ("ignore_patterns", ["original/**/*"], _refused()),
        ("use_tqdm_on_load", True, _works("model_executor/loader.py: a bar over the safetensors files (rank 0)")),
        ("pt_load_map_location", "cpu", _refused("PyTorch .bin/.pt checkpoints are not loaded")),
    ]),
    ("AttentionConfig", [("attention_backend", None, _refused())]),
    ("MambaConfig", [
        ("mamba_backend", "triton", _refused()),
        ("mamba_ssu_algorithm", None, _refused()),
        ("enable_mamba_cache_stochastic_rounding", False, _refused()),
        ("mamba_cache_philox_rounds", 0, _refused()),
    ]),
    ("StructuredOutputsConfig", [
        ("reasoning_parser", "", _refused("reasoning parsers belong to the OpenAI server")),
        ("reasoning_parser_plugin", None, _refused("reasoning parsers belong to the OpenAI server")),
    ]),
    ("ParallelConfig", [
        ("distributed_executor_backend", None, _works("executor/ ('mp', 'external_launcher'; not 'ray')")),
        *[(n, d, _refused()) for n, d in [
            ("pipeline_parallel_size", 1), ("master_addr", "127.0.0.1"), ("master_port", 29501),
            ("nnodes", 1), ("node_rank", 0), ("distributed_timeout_seconds", None),
            ("cpu_distributed_timeout_seconds", None), ("numa_bind", False), ("numa_bind_nodes", None),
            ("numa_bind_cpus", None), ("device_ids", None)]],
        ("tensor_parallel_size", 1, _works("executor/multiproc_executor.py")),
        *[(n, d, _refused()) for n, d in [
            ("prefill_context_parallel_size", 1), ("decode_context_parallel_size", 1),
            ("dcp_comm_backend", None), ("dcp_q_replicate", None), ("dcp_kv_cache_interleave_size", 1),
            ("cp_kv_cache_interleave_size", None), ("data_parallel_size", 1), ("data_parallel_rank", None),
            ("data_parallel_start_rank", None), ("data_parallel_size_local", None),
            ("data_parallel_address", None), ("data_parallel_rpc_port", None),
            ("data_parallel_hybrid_lb", False), ("data_parallel_external_lb", False),
            ("data_parallel_multi_port_external_lb", False), ("data_parallel_backend", "mp"),
            ("enable_hc_sp", False), ("enable_expert_parallel", False),
            ("enable_batch_sharded_sampling", None), ("enable_ep_weight_filter", False),
            ("all2all_backend", "allgather_reducescatter"), ("enable_elastic_ep", False),
            ("elastic_ep_max_dp_size", None), ("enable_dbo", False), ("ubatch_size", 0),
            ("dbo_decode_token_threshold", 32), ("dp_sync_interval", 16),
            ("dbo_prefill_token_threshold", 512), ("disable_nccl_for_dp_synchronization", None),
            ("eplb_config", DEFAULT_CONFIG), ("enable_eplb", False), ("expert_placement_strategy", "linear"),
            ("_api_process_count", 1), ("_api_process_rank", 0), ("max_parallel_loading_workers", None)]],
        ("disable_custom_all_reduce", False, _works("accepted: ranks all-reduce through torch.distributed "
                                                     "only; there is no custom all-reduce to disable")),
        ("enable_shm_tensor_arena", False, _refused()),
        ("ray_workers_use_nsight", False, _refused()),
        ("worker_cls", "auto", _refused("ferrollm's workers cannot be replaced")),
        ("worker_extension_cls", "", _refused("ferrollm's workers cannot be extended")),
        ("fault_tolerance_config", DEFAULT_CONFIG, _refused()),
        ("enable_fault_tolerance", False, _refused()),
    ]),
    ("CacheConfig", [
        ("kv_cache_dtype", "auto", _works("CPU: fp8 e4m3/e5m2 cache with per-tensor scales (Rust kernels); refused on GPUs")),
        ("block_size", None, _works("engine core (Rust): tokens per KV block; None is 16")),
        ("enable_prefix_caching", None, _works("engine core (Rust); None is True")),
        ("prefix_caching_hash_algo", "sha256", _refused("the core hashes blocks with its own function")),
        ("prefix_cache_retention_interval", 0, _refused()),
        ("gpu_memory_utilization", 0.92, _works("worker/gpu_profiler.py (GPU only)")),
        ("kv_cache_memory_bytes", None, _works("replaces FERROLLM_CPU_KVCACHE_SPACE / gpu_memory_utilization sizing")),
        ("num_gpu_blocks_override", None, _works("the KV block count, on the CPU too")),
        ("kv_cache_dtype_skip_layers", [], _refused()),
        ("mamba_cache_dtype", "auto", _refused("no Mamba/SSM models in ferrollm")),
        ("mamba_ssm_cache_dtype", "auto", _refused("no Mamba/SSM models in ferrollm")),
        ("mamba_block_size", None, _refused("no Mamba/SSM models in ferrollm")),
        ("prefix_match_unit", None, _refused()),
        ("mamba_cache_mode", "none", _refused("no Mamba/SSM models in ferrollm")),
        ("enable_mamba_shared_prefix_checkpoint", False, _refused("no Mamba/SSM models in ferrollm")),
        ("replayssm_buffer_len", 16, _refused("no Mamba/SSM models in ferrollm")),
        ("use_replayssm", False, _refused("no Mamba/SSM models in ferrollm")),
        ("kv_sharing_fast_prefill", False, _refused()),
        ("swa_bounded_replay", True, _refused()),
        ("kv_offloading_size", None, _refused("KV cache offloading is not supported")),
        ("kv_offloading_backend", "native", _refused("KV cache offloading is not supported")),
    ]),
    ("OffloadConfig", [(n, d, _refused()) for n, d in [
        ("offload_backend", "auto"), ("cpu_offload_gb", 0), ("cpu_offload_params", set()),
        ("offload_group_size", 0), ("offload_num_in_group", 1), ("offload_prefetch_step", 1),
        ("offload_params", set())]]),
    ("MultiModalConfig", [
        ("language_model_only", False, _works("multimodal/setup.py: the vision tower is not loaded")),
        ("limit_mm_per_prompt", DEFAULT_CONFIG, _works("multimodal/processor.py (images, video for Qwen2-VL; 0 for all: no vision tower)")),
        ("mm_processor_kwargs", None, _works("multimodal/processor.py (the image and video processors' keys)")),
        ("mm_processor_cache_gb", 4, _works("multimodal/cache.py (the Rust core's LRU; env var when None)")),
        *[(n, d, _refused()) for n, d in [
            ("enable_mm_embeds", False),
            ("interleave_mm_strings", False), ("media_io_kwargs", {}), ("mm_processor_cache_type", "lru"),
            ("mm_hasher_algorithm", "blake3"), ("mm_shm_cache_max_object_size_mb", 128),
            ("mm_encoder_only", False), ("mm_encoder_tp_mode", "weights"), ("mm_encoder_attn_backend", None),
            ("mm_encoder_attn_dtype", None), ("mm_encoder_fp8_scale_path", None),
            ("mm_encoder_fp8_scale_save_path", None), ("mm_encoder_fp8_scale_save_margin", 1.5),
            ("skip_mm_profiling", False), ("video_pruning_rate", None), ("video_pruning_method", "evs"),
            ("mm_tensor_ipc", "direct_rpc"), ("mm_processor_device", "auto"), ("mm_ipc_gpu_memory_gb", 0),
            ("mm_device_do_normalize", True)]],
    ]),
    ("LoRAConfig", [(n, d, _refused()) for n, d in [
        ("enable_lora", False), ("max_loras", 1), ("max_lora_rank", 16), ("default_mm_loras", None),
        ("fully_sharded_loras", False), ("max_cpu_loras", None), ("lora_dtype", "auto"),
        ("lora_target_modules", None), ("enable_tower_connector_lora", False),
        ("specialize_active_lora", False), ("enable_mixed_moe_lora_format", False),
        ("enable_moe_shared_loras", False), ("max_lora_cls_labels", None)]]),
    ("LoggingConfig", [(n, None, _refused()) for n in ("logging_config", "log_level", "log_config_file")]),
    ("ObservabilityConfig", [(n, d, _refused()) for n, d in [
        ("show_hidden_metrics_for_version", None), ("otlp_traces_endpoint", None),
        ("collect_detailed_traces", None), ("per_request_spec_decode_metrics", "none"),
        ("kv_cache_metrics", False), ("kv_cache_metrics_sample", 0.01), ("custom_histogram_buckets", None),
        ("cudagraph_metrics", False), ("enable_layerwise_nvtx_tracing", False), ("enable_mfu_metrics", False),
        ("enable_logging_iteration_details", False), ("jit_monitor_mode", "warn"),
        ("jit_monitor_verbose", False), ("enable_mm_processor_stats", False)]]),
    ("SchedulerConfig", [
        ("max_num_batched_tokens", None, _works("engine core (Rust) scheduler")),
        ("max_num_scheduled_tokens", None, _refused()),
        ("long_prefill_token_threshold", 0, _works("the Rust scheduler")),
        ("long_prefill_token_threshold_adaptive", False, _refused()),
        ("max_num_seqs", None, _works("engine core (Rust) scheduler; None is 256")),
        ("max_num_active_seqs", None, _refused()),
        ("max_num_queued_reqs", None, _refused()),
        ("max_num_queued_tokens", None, _refused()),
        ("enable_chunked_prefill", None, _works("the Rust scheduler")),
        ("disable_chunked_mm_input", False, _refused("set by the model: on for Gemma 3 (it attends both ways inside an image), else chunked prefill may split an image's placeholders (its encoder output is kept until all are computed)")),
        ("scheduler_reserve_full_isl", True, _refused()),
        ("prefill_schedule_interval", 1, _refused()),
        ("watermark", 0.0, _refused()),
        ("disable_hybrid_kv_cache_manager", None, _refused()),
        ("scheduling_policy", "fcfs", _works("the Rust scheduler: fcfs or priority")),
        ("scheduler_cls", None, _refused("the scheduler is ferrollm's Rust core")),
        ("async_scheduling", None, _works("engine/async_outputs.py: each step's output processing overlaps the caller; "
                                          "the next step is still scheduled after it")),
        ("stream_interval", 1, _refused()),
    ]),
    ("CompilationConfig", [
        ("cudagraph_capture_sizes", None, _works("config/compilation.py (folded into compilation_config)")),
        ("max_cudagraph_capture_size", None, _works("config/compilation.py (folded into compilation_config)")),
    ]),
    ("KernelConfig", [(n, d, _refused()) for n, d in [
        ("ir_op_priority", DEFAULT_CONFIG), ("moe_backend", "auto"), ("linear_backend", "auto"),
        ("sparse_indexer_topk_backend", "auto"), ("enable_flashinfer_autotune", None)]]),
    ("VllmConfig", [
        ("disable_log_stats", False, _works("engine/stats.py: RequestOutput.metrics and a periodic throughput log")),
        ("aggregate_engine_logging", False, _refused("one engine: nothing to aggregate")),
        ("structured_outputs_config", DEFAULT_CONFIG, _refused(GROUP_REASONS["StructuredOutputsConfig"])),
        ("aux_output_config", DEFAULT_CONFIG, _refused()),
        *[(n, None, _refused("speculative decoding is not supported"))
          for n in ("speculative_config", "spec_method", "spec_model", "spec_tokens")],
        ("watermark_config", None, _refused()),
        ("diffusion_config", None, _refused()),
        ("compilation_config", DEFAULT_CONFIG, _works("config/compilation.py")),
        ("attention_config", DEFAULT_CONFIG, _refused(GROUP_REASONS["AttentionConfig"])),
        ("engram_config", None, _refused()),
        ("mamba_config", DEFAULT_CONFIG, _refused(GROUP_REASONS["MambaConfig"])),
        ("kernel_config", DEFAULT_CONFIG, _refused(GROUP_REASONS["KernelConfig"])),
        ("profiler_config", DEFAULT_CONFIG, _refused("use torch.profiler around LLM calls")),
        ("kv_transfer_config", None, _refused("KV transfer (disaggregated prefill) is not supported")),
        ("kv_events_config", None, _refused("KV cache events are not published")),
        ("ec_transfer_config", None, _refused(GROUP_REASONS["MultiModalConfig"])),
        ("ec_manager_config", DEFAULT_CONFIG, _refused(GROUP_REASONS["MultiModalConfig"])),
        ("reasoning_config", None, _refused("reasoning parsers belong to the OpenAI server")),
        ("additional_config", {}, _refused("no platform plugins read it")),
        ("optimization_level", 2, _refused("use `compilation_config` and `enforce_eager`")),
        ("performance_mode", "balanced", _refused()),
        ("tokens_only", False, _refused()),
        ("shutdown_timeout", 0, _refused("`LLM.close()` shuts the engine down at once")),
        ("weight_transfer_config", None, _refused()),
        ("fail_on_environ_validation", False, _refused()),
        ("gdn_prefill_backend", None, _refused(GROUP_REASONS["KernelConfig"])),
        ("kda_prefill_backend", None, _refused(GROUP_REASONS["KernelConfig"])),
        ("kda_decode_backend", None, _refused(GROUP_REASONS["KernelConfig"])),
    ]),
    # ferrollm's own options, beyond vLLM's list.
    ("ferrollm", [
        ("device", "auto", _works(_W_ENGINE + ": 'auto', 'cpu' or 'cuda' (vLLM picks its platform)")),
    ]),
]


def _build() -> tuple[EngineArg, ...]:
    out = []
    for group, entries in _TABLE:
        for name, default, (works, refused) in entries:
            why = None if works is not None else (refused or GROUP_REASONS[group])
            out.append(EngineArg(name, group, default, works, why))
    return tuple(out)


ENGINE_ARGS: tuple[EngineArg, ...] = _build()
BY_NAME: dict[str, EngineArg] = {a.name: a for a in ENGINE_ARGS}


def is_default(arg: EngineArg, value: Any) -> bool:
    """Whether `value` is vLLM's default for `arg` (None or {} stand for a default config)."""
    if arg.default == DEFAULT_CONFIG:
        return value is None or value == {} or value == DEFAULT_CONFIG
    if value is None and isinstance(arg.default, (dict, list, set)) and not arg.default:
        return True  # vLLM's LLM passes None for an empty container
    if value is None or arg.default is None or isinstance(value, bool) != isinstance(arg.default, bool):
        return value is arg.default
    try:
        return bool(value == arg.default)
    except Exception:  # an array or tensor: never equal to a literal default
        return False
