"""The Rust CPU kernels (``rust/kernels``) on torch tensors: the matrix-vector product that
decode steps with a few rows spend most of their time in.

The kernels run on torch's own OpenMP team (see the crate's ``openmp`` module for why), which they
join the first time they are used. Where torch runs on another thread pool, or the process has no
OpenMP runtime to join, :func:`gemv_supported` says no and callers keep their torch path; so do
``FERROLLM_CPU_KERNELS=0``, other dtypes and other devices.
"""

from __future__ import annotations

import functools
import os
import re

import torch

from ferrollm import _core
from ferrollm.exceptions import KernelError

__all__ = ["GEMV_MAX_ROWS", "gemv", "gemv_supported"]

# The kernel's limit (`gemv::MAX_ROWS`): from three rows on, oneDNN's blocked GEMM is as fast.
GEMV_MAX_ROWS = 2

_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
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


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`gemv` takes ``x @ weight.T``: CPU tensors, both fp32 or both bf16, at most
    :data:`GEMV_MAX_ROWS` rows, and torch's OpenMP team joined."""
    # A strided weight (a view) would be copied whole on every call: leave it to torch.
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_MAX_ROWS and weight.dim() == 2
            and weight.is_contiguous() and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype in _NAMES and weight.dtype == x.dtype and _joined_openmp())


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x``: ``[rows, in]``, ``weight``: ``[out, in]``, streaming
    ``weight`` once on torch's threads. Accumulates in float32 and rounds once to ``x``'s dtype.
    Call only where :func:`gemv_supported` holds."""
    x = x.contiguous()
    rows, in_features = x.shape
    out = x.new_empty((rows, weight.shape[0]))
    bias_buf = None
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
        bias_buf = (bias.data_ptr(), bias.numel())
    _core.cpu_gemv(_NAMES[x.dtype], (x.data_ptr(), x.numel()), (weight.data_ptr(), weight.numel()),
                   bias_buf, (out.data_ptr(), out.numel()), rows, weight.shape[0], in_features,
                   torch.get_num_threads())
    return out
