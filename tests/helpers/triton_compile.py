"""Compiles every Triton kernel for a GPU target on a machine without one.

Triton's interpreter runs kernels as numpy code and so lets through what the GPU compiler
refuses (``tl.dot`` shape rules, mixed dtypes, unsupported ops). This module calls each kernel
wrapper on CPU tensors with ``JITFunction.run`` replaced by a recorder, then compiles each
recorded launch down to a cubin with ``triton.compile``; ptxas ships with Triton, so no driver
or device is needed.

Run as ``python -m helpers.triton_compile [--quant] [sm ...]`` from ``tests/``, without
``TRITON_INTERPRET``; ``--quant`` compiles only the quantized kernels.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
                  torch.int32: "*i32", torch.int64: "*i64", torch.int8: "*i8", torch.uint8: "*u8"}


def record_launches(calls) -> list[tuple[JITFunction, tuple, dict]]:
    """Runs ``calls`` (wrappers on CPU tensors) and returns the launches they asked for."""
    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        for call in calls:
            call()
    finally:
        JITFunction.run = original
    return launches


def compile_launch(fn: JITFunction, args: tuple, kwargs: dict, sm: int):
    """Compiles one recorded launch for ``sm_<sm>``; returns the compiled kernel."""
    values = dict(zip(fn.arg_names, args)) | kwargs
    signature, constexprs = {}, {}
    for param in fn.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {param.name}={value!r}")
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return triton.compile(source, target=GPUTarget("cuda", sm, 32), options=options)


def kernel_calls(sm: int = 90):
    """One call per kernel configuration the engine uses, on CPU tensors of real model shapes."""
    from ferrollm.kernels import triton as k

    def t(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype)

    tables, seq_lens = torch.zeros(4, 8, dtype=torch.int32), torch.ones(4, dtype=torch.int32)
    qsl = torch.arange(5, dtype=torch.int32)
    calls = [lambda: k.reshape_and_cache(t(4, 8, 128), t(4, 8, 128), t(2, 64, 16, 8, 128), torch.zeros(4, dtype=torch.int64))]
    for dtype, heads, dim, window, cap in [(torch.bfloat16, 32, 128, None, None), (torch.bfloat16, 16, 256, 4096, 50.0),
                                           (torch.float32, 14, 64, None, None), (torch.float16, 8, 80, 128, None)]:
        cache = t(2, 64, 16, 8 if heads % 8 == 0 else 2, dim, dtype=dtype)
        q = t(4, heads, dim, dtype=dtype)
        calls.append(lambda q=q, c=cache, w=window, s=cap: k.paged_attention_decode(q, c, tables, seq_lens, 0.1, w, s))
        calls.append(lambda q=q, c=cache, w=window, s=cap: k.paged_attention_prefill(q, c, tables, seq_lens, qsl, 1, 0.1, w, s))
    calls += [
        lambda: k.rms_norm(t(4, 4096), t(4096), 1e-6),
        lambda: k.fused_add_rms_norm(t(4, 4096), t(4, 4096), t(4096), 1e-6),
        lambda: k.rms_norm(t(4, 896, dtype=torch.float32), t(896, dtype=torch.float32), 1e-6),
        lambda: k.rotary_embedding(torch.zeros(4, dtype=torch.int64), t(4, 32 * 128), t(4, 8 * 128), 128, t(4096, 128)),
        lambda: k.rotary_embedding(torch.zeros(4, dtype=torch.int64), t(4, 14 * 64), t(4, 2 * 64), 64, t(4096, 32), False),
        lambda: k.silu_and_mul(t(4, 2 * 11008)),
    ]
    return calls + quant_kernel_calls(sm)


def quant_kernel_calls(sm: int):
    """The quantized matmuls and their activation quantizers; float8 dots where ``sm`` has them."""
    from ferrollm.kernels import triton as k

    def t(*shape, dtype=torch.bfloat16):
        return torch.zeros(*shape, dtype=dtype)

    x, big, f32 = t(4, 4096), t(256, 4096), torch.float32
    scales = t(1024, 32, dtype=f32)
    fp8_w, fp8_dot = t(1024, 4096, dtype=torch.float8_e4m3fn), sm >= 89
    return [
        lambda: k.scaled_int8_quant(x),
        lambda: k.scaled_int8_quant(x, torch.ones(1), 3),
        lambda: k.scaled_fp8_quant(x),  # per-row maxima, then the static quantizer
        lambda: k.scaled_fp8_quant(x, group_size=128),
        lambda: k.wq_linear(x, t(1024, 2048, dtype=torch.uint8), scales, scales, 4, 128, t(1024)),
        lambda: k.wq_linear(t(4, 4096, dtype=torch.float16), t(1024, 4096, dtype=torch.int8), scales, None, 8, 128),
        lambda: k.wq_linear(t(4, 4096, dtype=f32), t(1024, 2048, dtype=torch.uint8), scales, None, 4, 128),
        lambda: k.w8a8_linear(x, t(1024, 4096, dtype=torch.int8), t(1024, dtype=f32), t(1024)),
        lambda: k.w8a8_linear(x, t(1024, 4096, dtype=torch.int8), t(1024, dtype=f32), None, torch.ones(1), 3),
        lambda: k.fp8_linear(x, fp8_w, torch.ones(()), None, None, "tensor", fp8_dot=fp8_dot),
        lambda: k.fp8_linear(x, fp8_w, t(1024, dtype=f32), t(1024), None, "none", fp8_dot=fp8_dot),
        lambda: k.fp8_linear(x, fp8_w, t(8, 32, dtype=f32), None, (128, 128), "group", fp8_dot=fp8_dot),
        lambda: k.fp8_linear(t(4, 4096, dtype=f32), fp8_w, t(8, 32, dtype=f32), None, (128, 128), "none",
                             fp8_dot=fp8_dot),
        # Prefill batches take the wide tiles (128 x 128, 8 warps).
        lambda: k.wq_linear(big, t(1024, 2048, dtype=torch.uint8), scales, scales, 4, 128),
        lambda: k.w8a8_linear(big, t(1024, 4096, dtype=torch.int8), t(1024, dtype=f32)),
        lambda: k.fp8_linear(big, fp8_w, torch.ones(()), None, None, "tensor", fp8_dot=fp8_dot),
        lambda: k.fp8_linear(big, fp8_w, t(8, 32, dtype=f32), None, (128, 128), "group", fp8_dot=fp8_dot),
    ]


def main(sms: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    only_quant = "--quant" in sms
    failures = 0
    for sm in (int(a) for a in sms if a != "--quant"):
        launches = record_launches(quant_kernel_calls(sm) if only_quant else kernel_calls(sm))
        for fn, args, kwargs in launches:
            start = time.perf_counter()
            try:
                compiled = compile_launch(fn, args, kwargs, sm)
                print(f"sm_{sm} {fn.__name__}: ok, {len(compiled.asm['cubin'])} bytes of cubin, "
                      f"{time.perf_counter() - start:.1f}s")
            except Exception as e:  # report every kernel, not just the first failure
                failures += 1
                print(f"sm_{sm} {fn.__name__}: FAILED {type(e).__name__}: {e}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["90"]))
