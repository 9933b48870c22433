"""Keeps freed activation memory inside the process on the CPU.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh `mmap` and
gives it back with `munmap` when freed. A 4096-token prefill step allocates and frees gate/up
outputs of 160 MB per layer, so each step pays page faults on every page again. On the
development VM a first touch costs ~1.5 ms per MB against ~0.1 ms once mapped (the host backs
guest pages lazily and takes freed ones back), which made a fused SiLU-and-mul of a 4096-row
step 115 ms instead of 33 ms. Bare-metal hosts pay the faults and zeroing too, which is why
vLLM's CPU backend preloads tcmalloc.

Turning off glibc's mmap use and heap trimming (`mallopt`) makes freed blocks stay in the heap
for the next step. The cost is that the process keeps its peak heap; it is applied after the
weights are loaded, so loading's temporaries are still returned. `FERROLLM_CPU_MALLOC_TUNING=0`
leaves glibc's defaults alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["keep_freed_memory"]

# From glibc's malloc.h.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_applied = False


def keep_freed_memory() -> bool:
    """Applies the tuning once per process; returns whether it is in effect (glibc only)."""
    global _applied
    if _applied:
        return True
    if os.environ.get("FERROLLM_CPU_MALLOC_TUNING", "1") == "0" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success.
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied
