# The contract of the native module `ferrollm._core` (rust/bindings). Every verb that crosses the
# Rust/Python boundary is listed here; `make test` runs mypy.stubtest so stub and module agree.
import os
from typing import Any, final

import numpy as np
import numpy.typing as npt

__all__ = [
    "CpuDecoder",
    "EngineCore",
    "EngineCoreOutput",
    "MultiModalCache",
    "NewRequestData",
    "SamplingOptions",
    "SchedulerOutput",
    "StepBroadcaster",
    "StepReceiver",
    "Tokenizer",
    "__version__",
    "cpu_fp8_linear",
    "cpu_gemm",
    "cpu_gemm_bf16",
    "cpu_gemm_bf16_kernel",
    "cpu_gemm_bf16_pack",
    "cpu_gemm_bf16_packed_len",
    "cpu_gemm_pack",
    "cpu_gemm_packed_len",
    "cpu_gemm_silu_mul",
    "cpu_gemm_vectorized",
    "cpu_gemv",
    "cpu_gguf_deinterleave",
    "cpu_gguf_dequantize",
    "cpu_gguf_embedding",
    "cpu_gguf_interleave",
    "cpu_gguf_interleave_preferred",
    "cpu_gguf_interleaved_len",
    "cpu_gguf_linear",
    "cpu_gguf_linear_supported",
    "cpu_gguf_supported",
    "cpu_openmp_attach",
    "cpu_paged_decode",
    "cpu_paged_prefill",
    "cpu_paged_prefill_supported",
    "cpu_rms_norm",
    "cpu_rotary_neox",
    "cpu_sample_rows",
    "cpu_silu_and_mul",
    "cpu_w8a8_linear",
    "cpu_w8a8_pack",
    "cpu_w8a8_packed_len",
    "cpu_wq_int4_packed_len",
    "cpu_wq_linear",
    "cpu_wq_pack_int4",
    "cpu_write_kv",
    "cpu_write_kv_quantized",
]
__version__: str

@final
class SamplingOptions:
    """The sampling fields the core acts on (stop conditions, lengths, sampler values)."""

    def __new__(
        cls,
        *,
        max_tokens: int | None = ...,  # 16
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop: list[str] = ...,
        stop_token_ids: list[int] = ...,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        detokenize: bool = True,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        seed: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
    ) -> SamplingOptions: ...
    @property
    def max_tokens(self) -> int | None: ...
    @property
    def stop(self) -> list[str]: ...
    @property
    def stop_token_ids(self) -> list[int]: ...
    @property
    def logprobs(self) -> int | None: ...
    @property
    def prompt_logprobs(self) -> int | None: ...

@final
class Tokenizer:
    """An HF `tokenizers` tokenizer loaded from `tokenizer.json` or a model folder."""

    def __new__(cls, path: str | os.PathLike[str]) -> Tokenizer: ...
    @property
    def eos_token_ids(self) -> list[int]: ...
    @property
    def bos_token_id(self) -> int | None: ...
    @property
    def vocab_size(self) -> int: ...
    def token_to_id(self, token: str) -> int | None: ...
    def id_to_token(self, id: int) -> str | None: ...
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def decode_incrementally(
        self, prompt_token_ids: list[int], token_ids: list[int], skip_special_tokens: bool = True
    ) -> list[str]: ...

@final
class NewRequestData:
    """A request the runner sees for the first time."""

    @property
    def req_index(self) -> int: ...
    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def sampling(self) -> SamplingOptions: ...
    @property
    def block_ids(self) -> list[int]: ...
    @property
    def num_computed_tokens(self) -> int: ...

@final
class SchedulerOutput:
    """One step's arrays; row i of each per-request array is the i-th scheduled request."""

    def __len__(self) -> int: ...
    @property
    def step_id(self) -> int: ...
    @property
    def num_reqs(self) -> int: ...
    @property
    def total_num_scheduled_tokens(self) -> int: ...
    @property
    def req_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def num_computed_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def needs_sample(self) -> npt.NDArray[np.bool_]: ...
    @property
    def temperature(self) -> npt.NDArray[np.float32]: ...
    @property
    def top_p(self) -> npt.NDArray[np.float32]: ...
    @property
    def top_k(self) -> npt.NDArray[np.int32]: ...
    @property
    def min_p(self) -> npt.NDArray[np.float32]: ...
    @property
    def seeds(self) -> npt.NDArray[np.int64]: ...
    @property
    def presence_penalty(self) -> npt.NDArray[np.float32]: ...
    @property
    def frequency_penalty(self) -> npt.NDArray[np.float32]: ...
    @property
    def repetition_penalty(self) -> npt.NDArray[np.float32]: ...
    @property
    def scheduled_new_reqs(self) -> list[NewRequestData]: ...
    @property
    def cached_req_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def cached_resumed(self) -> npt.NDArray[np.bool_]: ...
    @property
    def cached_num_computed_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def cached_new_block_ids(self) -> npt.NDArray[np.int32]: ...
    @property
    def cached_new_block_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def finished_req_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def preempted_req_indices(self) -> npt.NDArray[np.int64]: ...

@final
class EngineCoreOutput:
    """A finished request (or, when streaming, what is new for a request)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def text(self) -> str: ...
    @property
    def finished(self) -> bool: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def stop_reason(self) -> int | str | None: ...
    @property
    def num_cached_tokens(self) -> int: ...

@final
class EngineCore:
    """The engine core: requests, scheduler, KV cache bookkeeping and tokenizer pipeline."""

    def __new__(
        cls,
        *,
        tokenizer: Tokenizer | str | os.PathLike[str] | None = None,
        block_size: int = 16,
        num_blocks: int = 1024,
        enable_prefix_caching: bool = True,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 4096,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        stream_outputs: bool = False,
        sliding_window: int | None = None,
        max_num_encoder_input_tokens: int | None = None,
        disable_chunked_mm_input: bool = False,
    ) -> EngineCore: ...
    def add_requests(
        self,
        request_ids: list[str],
        prompts: list[str] | list[list[int]] | list[str | list[int]],
        params: list[SamplingOptions],
        priorities: list[int] | None = None,
        cache_salts: list[str | None] | None = None,
        add_special_tokens: bool = True,
        mm_features: list[list[tuple[str, int, int]]] | None = None,
    ) -> None: ...
    def schedule(self) -> SchedulerOutput: ...
    def set_step_broadcaster(self, broadcaster: StepBroadcaster | None) -> None: ...
    def update(self, sampled: npt.NDArray[np.int64] | list[int]) -> list[EngineCoreOutput]: ...
    def abort_requests(self, request_ids: list[str]) -> int: ...
    def abort_all_requests(self) -> int: ...
    def has_unfinished_requests(self) -> bool: ...
    def reset_prefix_cache(self) -> bool: ...
    def stats(self) -> dict[str, int | float]: ...
    def block_ids(self, request_id: str) -> list[int] | None: ...
    def block_ref_count(self, block_id: int) -> int: ...
    def get_tokenizer(self) -> Tokenizer | None: ...

@final
class MultiModalCache:
    """A byte-bounded LRU of processed multimodal items: (buffer, metadata) by content hash."""

    def __new__(cls, capacity_bytes: int) -> MultiModalCache: ...
    @property
    def capacity_bytes(self) -> int: ...
    def get(self, key: str) -> tuple[bytes, str] | None: ...
    def contains(self, key: str) -> bool: ...
    def put(self, key: str, data: bytes, metadata: str) -> bool: ...
    def clear(self) -> None: ...
    def stats(self) -> dict[str, int]: ...

@final
class CpuDecoder:
    """A model's decoder layers for one-call decode steps (`ferrollm.kernels.cpu.decoder`): the
    weights' addresses, kept by the caller alive as long as this object."""

    def __new__(
        cls,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        intermediate: int,
        eps: float,
        scale: float,
        layers: list[tuple[_Buffer, _Buffer, tuple[Any, ...], _Buffer | None, tuple[Any, ...], tuple[Any, ...],
                           tuple[Any, ...]]],
        dtype: str = "float32",
        final_norm: _Buffer | None = None,
        lm_head: tuple[tuple[Any, ...], int] | None = None,
    ) -> CpuDecoder: ...
    def __len__(self) -> int: ...
    def run(
        self,
        hidden: _Buffer,
        residual: _Buffer,
        positions: _Buffer,
        slot_mapping: _Buffer,
        block_tables: _Buffer,
        max_blocks_per_seq: int,
        seq_lens: _Buffer,
        block_size: int,
        cos_sin: _Buffer,
        caches: list[tuple[_Buffer, _Buffer]],
        threads: int,
        query_start_loc: _Buffer | None = None,
        sample: tuple[_Buffer, _Buffer, _Buffer | None] | None = None,
    ) -> None: ...

@final
class StepBroadcaster:
    """Rank 0's end of the shared-memory step channel; attach it with
    `EngineCore.set_step_broadcaster` and every `schedule()` publishes its step."""

    def __new__(cls, num_readers: int, timeout_s: float = 60.0) -> StepBroadcaster: ...
    @property
    def path(self) -> str: ...
    @property
    def num_readers(self) -> int: ...
    @property
    def seq(self) -> int: ...
    def publish_control(self) -> None: ...
    def publish_shutdown(self) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...

@final
class StepReceiver:
    """A worker rank's end of the step channel."""

    def __new__(cls, path: str | os.PathLike[str], reader: int) -> StepReceiver: ...
    def recv(self, timeout_s: float) -> SchedulerOutput | str | None: ...

# The CPU kernels (`rust/kernels`), on `(data_ptr, numel)` buffers of contiguous tensors; see
# `ferrollm.cpu_kernels`, their only caller.
_Buffer = tuple[int, int]

def cpu_openmp_attach(path: str) -> None: ...
def cpu_gemv(
    dtype: str,
    x: _Buffer,
    weight: _Buffer,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    threads: int,
) -> None: ...
def cpu_gemm_vectorized() -> bool: ...
def cpu_gemm_bf16_kernel() -> str: ...
def cpu_gemm_bf16_packed_len(out_features: int, in_features: int) -> int: ...
def cpu_gemm_bf16_pack(
    weight: _Buffer, packed: _Buffer, out_features: int, in_features: int, first_row: int, rows: int, stride: int,
    threads: int,
) -> None: ...
def cpu_gemm_bf16(
    dtype: str,
    x: _Buffer,
    packed: _Buffer,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    kernel: str,
    threads: int,
) -> None: ...
def cpu_gemm_packed_len(out_features: int, in_features: int) -> int: ...
def cpu_gemm_pack(
    weight: _Buffer, packed: _Buffer, out_features: int, in_features: int, first_row: int, rows: int, stride: int,
    threads: int,
) -> None: ...
def cpu_gemm(
    x: _Buffer,
    packed: _Buffer,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    threads: int,
) -> None: ...
def cpu_gemm_silu_mul(
    x: _Buffer,
    packed: _Buffer,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    width: int,
    in_features: int,
    threads: int,
) -> None: ...
def cpu_paged_decode(
    dtype: str,
    query: _Buffer,
    key_cache: _Buffer,
    value_cache: _Buffer,
    block_tables: _Buffer,
    seq_lens: _Buffer,
    out: _Buffer,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks_per_seq: int,
    scale: float,
    threads: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    cache_dtype: str | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None: ...
def cpu_paged_prefill_supported(head_dim: int) -> bool: ...
def cpu_paged_prefill(
    dtype: str,
    query: _Buffer,
    key_cache: _Buffer,
    value_cache: _Buffer,
    block_table: _Buffer,
    out: _Buffer,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_len: int,
    num_computed: int,
    scale: float,
    threads: int,
    sliding_window: int | None = None,
) -> None: ...
def cpu_rms_norm(
    dtype: str,
    x: _Buffer,
    weight: _Buffer,
    eps: float,
    gemma: bool,
    out: _Buffer,
    threads: int,
    residual: _Buffer | None = None,
    residual_out: _Buffer | None = None,
) -> None: ...
def cpu_silu_and_mul(dtype: str, x: _Buffer, width: int, out: _Buffer, threads: int) -> None: ...
def cpu_rotary_neox(
    dtype: str,
    x: _Buffer,
    positions: _Buffer,
    cos_sin: _Buffer,
    out: _Buffer,
    rows: int,
    row_stride: int,
    heads: int,
    head_size: int,
    rotary_dim: int,
    threads: int,
) -> None: ...
def cpu_write_kv(
    dtype: str,
    key: _Buffer,
    value: _Buffer,
    slot_mapping: _Buffer,
    key_cache: _Buffer,
    value_cache: _Buffer,
    tokens: int,
    width: int,
    key_stride: int,
    value_stride: int,
) -> None: ...
def cpu_write_kv_quantized(
    dtype: str,
    cache_dtype: str,
    key: _Buffer,
    value: _Buffer,
    slot_mapping: _Buffer,
    key_cache: _Buffer,
    value_cache: _Buffer,
    tokens: int,
    width: int,
    key_stride: int,
    value_stride: int,
    k_scale: float,
    v_scale: float,
) -> None: ...
def cpu_sample_rows(logits: _Buffer, vocab: int, uniforms: _Buffer, out: _Buffer, threads: int) -> None: ...

# GGUF block decoding (`rust/kernels/src/quant.rs`); see `ferrollm.kernels.cpu.gguf`, the caller.
def cpu_gguf_supported(ggml_type: int) -> bool: ...
def cpu_gguf_dequantize(ggml_type: int, data: _Buffer, dtype: str, out: _Buffer, threads: int) -> None: ...
def cpu_gguf_embedding(ggml_type: int, data: _Buffer, row_stride: int, ids: _Buffer, dtype: str, out: _Buffer,
                       threads: int) -> None: ...

# Quantized linear layers (`rust/kernels/src/quant/`); see `ferrollm.kernels.cpu.quant`, the caller.
def cpu_wq_int4_packed_len(out_features: int, in_features: int) -> int: ...
def cpu_wq_pack_int4(q: _Buffer, packed: _Buffer, out_features: int, in_features: int, threads: int) -> None: ...
def cpu_wq_linear(
    x: _Buffer,
    qweight: _Buffer,
    bits: int,
    scales: _Buffer,
    mins: _Buffer | None,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    group_size: int,
    threads: int,
) -> None: ...
def cpu_w8a8_packed_len(out_features: int, in_features: int) -> int: ...
def cpu_w8a8_pack(qweight: _Buffer, packed: _Buffer, out_features: int, in_features: int, threads: int) -> None: ...
def cpu_w8a8_linear(
    x: _Buffer,
    packed: _Buffer,
    weight_scale: _Buffer,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    input_scale: float | None,
    input_zero_point: int,
    threads: int,
) -> None: ...
def cpu_gguf_linear_supported(ggml_type: int) -> bool: ...
def cpu_gguf_interleave_preferred(ggml_type: int) -> bool: ...
def cpu_gguf_interleaved_len(ggml_type: int, out_features: int, in_features: int) -> int: ...
def cpu_gguf_interleave(
    ggml_type: int, rows: _Buffer, row_stride: int, out_features: int, in_features: int, dst: _Buffer
) -> None: ...
def cpu_gguf_deinterleave(ggml_type: int, src: _Buffer, out_features: int, in_features: int, dst: _Buffer) -> None: ...
def cpu_gguf_linear(
    weights: list[tuple[int, _Buffer, int, int, bool]],
    in_features: int,
    x: _Buffer,
    rows: int,
    bias: _Buffer | None,
    out: _Buffer,
    threads: int,
    residual: bool = False,
) -> None: ...
def cpu_fp8_linear(
    x: _Buffer,
    weight: _Buffer,
    weight_scale: _Buffer,
    scale_kind: str,
    block: tuple[int, int] | None,
    bias: _Buffer | None,
    out: _Buffer,
    rows: int,
    out_features: int,
    in_features: int,
    input_quant: str,
    input_scale: float | None,
    threads: int,
) -> None: ...
