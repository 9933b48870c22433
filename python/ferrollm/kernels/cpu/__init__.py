"""The Rust CPU kernels (``rust/kernels``) on torch tensors.

- :func:`gemv`: the matrix-vector product that decode steps with a few rows spend most of their
  time in, streaming each weight once;
- :func:`gemm` on a weight packed by :func:`gemm_pack`: the fp32 matrix product from two rows
  on (batched decode steps, prefill slabs), on AVX-512 CPUs; its bf16-weight sibling, on any
  CPU, is :mod:`ferrollm.kernels.cpu.gemm_bf16`;
- :func:`paged_prefill`: a request's prompt attention over its paged context (flash attention
  on AVX-512 CPUs), ~3x torch's fused attention, which also needed the context gathered first;
- :func:`rms_norm` / :func:`fused_add_rms_norm`, :func:`silu_and_mul`, :func:`rotary_neox` and
  :func:`paged_decode` (attention read in place from the block table): each replaces a chain of
  torch ops. At a few rows a chain costs its dispatches, not its arithmetic: a batch-1 decode
  layer of a Qwen2-0.5B-shaped model spent ~0.5 ms in ~60 small torch ops around its matmuls.

The kernels run on torch's own OpenMP team (see the crate's ``openmp`` module for why), which they
join the first time they are used. Where torch runs on another thread pool, or the process has no
OpenMP runtime to join, :func:`supports` says no and callers keep their torch path, which stays
the reference the kernels are tested against; so do ``FERROLLM_CPU_KERNELS=0``, dtypes other than
fp32 and bf16, and other devices. Arithmetic is float32, rounded where the torch path rounds, so
the two agree to within one rounding of the element type.
"""

from __future__ import annotations

import functools
import os
import re

import torch

from ferrollm import _core
from ferrollm.exceptions import KernelError

__all__ = ["GEMV_MAX_ROWS", "fused_add_rms_norm", "gemm", "gemm_pack", "gemm_pack_rows", "gemm_packed_len", "gemm_silu_mul",
           "gemm_rows", "gemm_supported", "gemm_unpack", "gemv",
           "gemv_supported", "paged_decode", "paged_decode_supported", "paged_prefill", "paged_prefill_supported",
           "rms_norm", "rotary_neox", "rotary_supported", "sample_rows", "silu_and_mul",
           "supports", "write_kv", "write_kv_supported"]

# The kernel's limit (`gemv::MAX_ROWS`): from three rows on, oneDNN's blocked GEMM is as fast.
# Where ferrollm's GEMM packed the weight it takes two rows too (see `cpu_weights.PackedWeight`).
GEMV_MAX_ROWS = 2
# Rows in a panel of the packed GEMMs' weights (`gemm::PANEL_WIDTH`).
PANEL_WIDTH = 48

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# KV cache formats the attention kernels read and write besides the model's dtype.
_FP8_NAMES = {torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}
# Runtimes that export the GNU OpenMP entry points: GCC's libgomp (torch's Linux wheels bundle
# one as libgomp-<hash>.so.1) and LLVM's libomp / Intel's libiomp5.
_OPENMP_LIBRARY = re.compile(r"/lib(gomp|omp|iomp5)([-.][^/]*)?\.so(\.[0-9]+)*$")


@functools.cache
def _joined_openmp() -> bool:
    """Joins torch's OpenMP team, once; False where torch has none or it cannot be found."""
    if os.environ.get("FERROLLM_CPU_KERNELS", "1") == "0":
        return False
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    for path in _loaded_libraries():
        if _OPENMP_LIBRARY.search(path):
            try:
                _core.cpu_openmp_attach(path)
                return True
            except KernelError:
                continue
    return False


def _loaded_libraries() -> list[str]:
    """Paths of the shared libraries mapped into this process (Linux's /proc; elsewhere none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return list(dict.fromkeys(line.split(maxsplit=5)[-1].strip() for line in maps if "/" in line))
    except OSError:
        return []


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these tensors: on the CPU, all fp32 or all bf16, with torch's
    OpenMP team joined."""
    # Called ~10 times per layer per step: plain loop and `is_cpu`, no generator or device object.
    dtype = tensors[0].dtype
    if dtype not in _NAMES:
        return False
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype:
            return False
    return _joined_openmp()


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``x @ weight.T``: at most :data:`GEMV_MAX_ROWS` rows, a
    contiguous weight, and tensors :func:`supports` takes."""
    # A strided weight (a view) would be copied whole on every call: leave it to torch.
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and weight.dim() == 2
            and weight.is_contiguous() and supports(x, weight))


def gemm_supported(weight: torch.Tensor) -> bool:
    """Whether :func:`gemm_pack` and :func:`gemm` take this weight: fp32 on the CPU, kernels joined,
    and a CPU on which the GEMM is vectorized (AVX-512); elsewhere oneDNN is faster.
    ``FERROLLM_CPU_GEMM=portable`` takes the GEMM's plain loop on any CPU instead: many times
    slower, it lets tests cover the packed path on CPUs without AVX-512."""
    return (weight.dtype == torch.float32 and weight.dim() == 2 and supports(weight)
            and (_core.cpu_gemm_vectorized() or os.environ.get("FERROLLM_CPU_GEMM") == "portable"))


def paged_decode_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` takes these: it reads the cache in place, so the cache must be
    the whole contiguous allocation, and tensors :func:`supports` takes (or an fp8 CPU cache)."""
    if kv_cache.dtype in _FP8_NAMES:
        return kv_cache.is_contiguous() and kv_cache.is_cpu and supports(query)
    return kv_cache.is_contiguous() and supports(query, kv_cache)


def paged_prefill_supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill` takes these: as :func:`paged_decode_supported`, on a CPU with
    AVX-512 and a head size that is a multiple of 64; not an fp8 cache."""
    return (kv_cache.dtype not in _FP8_NAMES and paged_decode_supported(query, kv_cache)
            and _core.cpu_paged_prefill_supported(query.shape[-1]))


def _buf(t: torch.Tensor) -> tuple[int, int]:
    # Only an address: the caller keeps `t` referenced until the kernel returns (a temporary made
    # by `.contiguous()` inside the call's arguments would be freed before the kernel reads it).
    return t.data_ptr(), t.numel()


def as_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` contiguous in ``dtype``. Per-step tensors usually already are, and a ``.to`` that
    does nothing still costs a dispatch: ~2 us warm, 10-20 us on the cache a decode step's
    weight streams have just evicted, several times a step."""
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def _threads() -> int:
    """Threads a kernel may split over: torch's, once its OpenMP team is joined (a kernel called
    before any ``*supported`` check would otherwise run on the calling thread alone)."""
    _joined_openmp()
    return torch.get_num_threads()


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x``: ``[rows, in]``, ``weight``: ``[out, in]``, streaming
    ``weight`` once on torch's threads. Accumulates in float32 and rounds once to ``x``'s dtype.
    Call only where :func:`gemv_supported` holds."""
    x = x.contiguous()
    rows, in_features = x.shape
    out = x.new_empty((rows, weight.shape[0]))
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    _core.cpu_gemv(_NAMES[x.dtype], _buf(x), _buf(weight), None if bias is None else _buf(bias), _buf(out),
                   rows, weight.shape[0], in_features, _threads())
    return out


def gemm_packed_len(out_features: int, in_features: int) -> int:
    """Elements of :func:`gemm`'s packed form of an ``[out_features, in_features]`` weight."""
    return _core.cpu_gemm_packed_len(out_features, in_features)


def gemm_pack(weight: torch.Tensor, parts: int = 1) -> torch.Tensor:
    """``weight`` (``[out, in]``, fp32) in :func:`gemm`'s panel layout: a flat fp32 tensor.
    ``parts=2`` packs each half of the rows on its own, one after the other: the layout
    :func:`gemm_silu_mul` reads a ``[gate, up]`` weight in. Call only where :func:`gemm_supported`
    holds."""
    out_features, in_features = weight.shape
    if parts < 1 or out_features % parts:
        raise KernelError(f"`parts` must be >= 1 and divide the {out_features} output features. Given: {parts}")
    rows = out_features // parts
    size = gemm_packed_len(rows, in_features)
    packed = torch.zeros(parts * size, dtype=torch.float32)
    for i in range(parts):
        gemm_pack_rows(weight[i * rows:(i + 1) * rows], packed[i * size:(i + 1) * size], rows, 0)
    return packed


def gemm_pack_rows(rows: torch.Tensor, packed: torch.Tensor, out_features: int, first_row: int) -> None:
    """Packs ``rows`` (fp32 ``[n, in]``, unit stride along ``in``, any row stride: a rank's columns
    of a row-parallel weight qualify) as rows ``first_row .. first_row + n`` of an
    ``[out_features, in]`` weight into ``packed`` (:func:`gemm_packed_len` elements, padding
    already zero), leaving the rest of ``packed`` as it is."""
    rows = rows.detach()
    if rows.dim() != 2 or (rows.shape[0] > 1 and rows.stride(1) != 1):
        rows = rows.contiguous()
    n, in_features = rows.shape
    span = (rows.data_ptr(), 0 if n == 0 else (n - 1) * rows.stride(0) + in_features)
    _core.cpu_gemm_pack(span, _buf(packed), out_features, in_features, first_row, n,
                        rows.stride(0) if n > 1 else in_features, _threads())


def gemm_unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The plain ``[out_features, in_features]`` weight :func:`gemm_pack` packed into ``packed``."""
    return gemm_rows(packed, out_features, in_features, torch.arange(out_features))


def gemm_rows(packed: torch.Tensor, out_features: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the ``[out_features, in_features]`` weight :func:`gemm_pack` packed
    into ``packed``: ``[*ids.shape, in_features]``. A tied LM head's packed table serves its
    embedding's lookups this way, so the table is held once."""
    return panel_rows(packed, out_features, in_features, 1, ids)


def panel_rows(packed: torch.Tensor, out_features: int, depth: int, group: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of a weight in the GEMMs' panel layout, ``[*ids.shape, depth * group]``.

    The rows, padded to a multiple of 16, go in panels of 48 (the last one takes the rest); a
    panel of ``width`` rows is ``[depth, width, group]``: ``group`` consecutive inputs of a row
    side by side (one in fp32, a pair in bf16), ``depth`` such steps along the input.
    """
    padded = -(-out_features // 16) * 16
    full, tail = divmod(padded, PANEL_WIDTH)
    split = full * PANEL_WIDTH * depth * group
    flat = ids.reshape(-1)
    panel, lane = flat // PANEL_WIDTH, flat % PANEL_WIDTH
    panels = packed[:split].view(full, depth, PANEL_WIDTH, group)
    if not tail or bool((panel < full).all()):
        rows = panels[panel, :, lane]
    else:
        rows = packed.new_empty((flat.numel(), depth, group))
        in_full = panel < full
        rows[in_full] = panels[panel[in_full], :, lane[in_full]]
        tails = packed[split:split + depth * tail * group].view(depth, tail, group)
        rows[~in_full] = tails[:, flat[~in_full] - full * PANEL_WIDTH].transpose(0, 1)
    return rows.reshape(*ids.shape, depth * group)


def gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x @ weight.T + bias`` for fp32 ``x``: ``[rows, in]``, ``packed`` from
    :func:`gemm_pack` of ``weight``, on torch's threads."""
    return _packed_product(_core.cpu_gemm, x, packed, bias, out_features)


def gemm_silu_mul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, width: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``[gate, up] = x @ weight.T + bias`` in one pass, for fp32 ``x``:
    ``[rows, in]`` and ``packed`` from ``gemm_pack(weight, parts=2)`` of a ``[2 * width, in]``
    weight; the ``[rows, 2 * width]`` product is never materialized. Equal, bit for bit, to
    :func:`gemm` then :func:`silu_and_mul`."""
    return _packed_product(_core.cpu_gemm_silu_mul, x, packed, bias, width)


def _packed_product(kernel, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                    width: int) -> torch.Tensor:
    """Runs a kernel of :func:`gemm`'s signature into a fresh ``[rows, width]`` output."""
    x = x.contiguous()
    rows, in_features = x.shape
    out = x.new_empty((rows, width))
    bias = None if bias is None else bias.contiguous()
    kernel(_buf(x), _buf(packed), None if bias is None else _buf(bias), _buf(out), rows, width, in_features,
           _threads())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """RMSNorm of ``x`` (``[..., hidden]``) as ``layers.norm.RMSNorm`` computes it; ``gemma``
    scales by ``1 + weight`` (``GemmaRMSNorm``)."""
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    _core.cpu_rms_norm(_NAMES[x.dtype], _buf(x), _buf(weight), eps, gemma, _buf(out), _threads())
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       gemma: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass."""
    x, residual, weight = x.contiguous(), residual.contiguous(), weight.contiguous()
    out, new_residual = torch.empty_like(x), torch.empty_like(x)
    _core.cpu_rms_norm(_NAMES[x.dtype], _buf(x), _buf(weight), eps, gemma, _buf(out),
                       _threads(), _buf(residual), _buf(new_residual))
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x``: ``[..., 2d]``."""
    x = x.contiguous()
    width = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], width))
    _core.cpu_silu_and_mul(_NAMES[x.dtype], _buf(x), width, _buf(out), _threads())
    return out


def rotary_supported(positions: torch.Tensor, cos_sin_cache: torch.Tensor, *xs: torch.Tensor) -> bool:
    """Whether :func:`rotary_neox` takes each of ``xs``: 2-D with unit-stride, non-overlapping
    rows (the query or key part of a fused qkv output qualifies), int64 positions, a contiguous
    table."""
    return (positions.dtype == torch.int64 and cos_sin_cache.is_contiguous()
            and all(x.dim() == 2 and x.stride(1) == 1 and x.stride(0) >= x.shape[1] for x in xs)
            and supports(cos_sin_cache, *xs))


def rotary_neox(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int,
                rotary_dim: int) -> torch.Tensor:
    """``x`` (``[tokens, heads * head_size]``, rows possibly strided) rotated NeoX style by
    ``cos_sin_cache[positions]`` (cosines then sines), as a new contiguous tensor. Call only where
    :func:`rotary_supported` holds."""
    rows, width = x.shape
    out = x.new_empty((rows, width))
    if rows == 0:
        return out
    positions = positions.contiguous()
    _core.cpu_rotary_neox(_NAMES[x.dtype], _rows(x, width), _buf(positions), _buf(cos_sin_cache),
                          _buf(out), rows, x.stride(0), width // head_size, head_size, rotary_dim,
                          _threads())
    return out


def write_kv_supported(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> bool:
    """Whether :func:`write_kv` takes these: keys and values ``[tokens, kv_heads, head_dim]`` whose
    rows may be strided but whose heads are contiguous, of the cache's dtype; the whole contiguous
    cache (or an fp8 CPU cache); int64 slots."""
    fp8 = kv_cache.dtype in _FP8_NAMES
    return (kv_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]
                    and t.stride(0) >= t.shape[1] * t.shape[2] for t in (key, value))
            and (supports(key, value) and kv_cache.is_cpu if fp8 else supports(kv_cache, key, value)))


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Writes token ``i``'s keys and values to slot ``slot_mapping[i]`` of one layer's cache
    (``[2, num_blocks, block_size, kv_heads, head_dim]``), as ``attention.cpu_backend.write_kv``
    does; an fp8 cache stores ``key / k_scale`` and ``value / v_scale``, rounded to nearest even
    and saturated. Call only where :func:`write_kv_supported` holds."""
    tokens, heads, head_dim = key.shape
    width = heads * head_dim
    slots = slot_mapping.contiguous()
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    args = (_rows(key, width), _rows(value, width), _buf(slots), _buf(key_cache), _buf(value_cache), tokens, width,
            key.stride(0), value.stride(0))
    if kv_cache.dtype in _FP8_NAMES:
        _core.cpu_write_kv_quantized(_NAMES[key.dtype], _FP8_NAMES[kv_cache.dtype], *args, k_scale, v_scale)
    else:
        _core.cpu_write_kv(_NAMES[key.dtype], *args)


def _rows(t: torch.Tensor, width: int) -> tuple[int, int]:
    """The span of a tensor whose rows (dim 0) are ``t.stride(0)`` apart and ``width`` long."""
    return t.data_ptr(), 0 if len(t) == 0 else (len(t) - 1) * t.stride(0) + width


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None = None,
                 soft_cap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Attention of one query token per row over its paged context, as
    ``attention.cpu_backend`` computes it.

    Args:
        query: ``[rows, num_heads, head_dim]``.
        kv_cache: one layer's cache, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[rows, max_blocks]`` block ids (any integer dtype).
        seq_lens: ``[rows]`` context lengths, the query token included.
        scale, sliding_window, soft_cap: as in ``cpu_backend.paged_attention``.
        k_scale, v_scale: what an fp8 cache's keys and values are multiplied by when read.

    Returns:
        ``[rows, num_heads, head_dim]`` in ``query``'s dtype.

    Call only where :func:`paged_decode_supported` holds.
    """
    query = query.contiguous()
    out = torch.empty_like(query)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    _core.cpu_paged_decode(_NAMES[query.dtype], _buf(query), _buf(kv_cache[0]), _buf(kv_cache[1]), _buf(tables),
                           _buf(lens), _buf(out), query.shape[1], kv_heads, head_dim, block_size,
                           tables.shape[1], scale, _threads(), sliding_window, soft_cap,
                           _FP8_NAMES.get(kv_cache.dtype), k_scale, v_scale)
    return out


def paged_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, num_computed: int,
                  scale: float, sliding_window: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of one request's query chunk over its paged context, as
    ``attention.cpu_backend`` computes it (without logit soft-capping).

    Args:
        query: ``[query_len, num_heads, head_dim]``, positions ``num_computed ..``; their keys and
            values must already be in the cache.
        kv_cache: one layer's cache, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_table: the request's block ids (any integer dtype).
        num_computed: context tokens before the chunk.
        scale, sliding_window: as in ``cpu_backend.paged_attention``.
        out: where to write the result (a contiguous tensor shaped and typed as ``query``, e.g.
            the request's rows of the step's output); a new tensor if not given.

    Returns:
        ``out``: ``[query_len, num_heads, head_dim]`` in ``query``'s dtype.

    Raises:
        KernelError: ``out`` is not contiguous or not ``query``'s shape and dtype.

    Call only where :func:`paged_prefill_supported` holds.
    """
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    elif not out.is_contiguous() or out.shape != query.shape or out.dtype != query.dtype:
        raise KernelError(f"`out` must be a contiguous {query.dtype} tensor of shape {tuple(query.shape)}. "
                          f"Given: {out.dtype}, {tuple(out.shape)}, contiguous={out.is_contiguous()}")
    table = block_table.to(torch.int32).contiguous()
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    _core.cpu_paged_prefill(_NAMES[query.dtype], _buf(query), _buf(kv_cache[0]), _buf(kv_cache[1]), _buf(table),
                            _buf(out), query.shape[1], kv_heads, head_dim, block_size, query.shape[0], num_computed,
                            scale, _threads(), sliding_window)
    return out


def sample_rows(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (``[rows, vocab]`` fp32), drawn with probability
    ``softmax(logits[r])`` by the inverse of the row's cumulative distribution at ``uniforms[r]``
    (float64 in [0, 1)); a ``-inf`` logit has no mass. Int64 ``[rows]``. Call only where
    :func:`supports` takes ``logits``."""
    logits = logits.contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    _core.cpu_sample_rows(_buf(logits), logits.shape[1], _buf(uniforms), _buf(out), _threads())
    return out
