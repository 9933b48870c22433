"""Copying checkpoint tensors into parameters, with the checks that turn a mismatched checkpoint
into a readable error instead of a silent broadcast or a torch shape error deep in a loader.

Under tensor parallelism checkpoint tensors arrive as :class:`LazyTensor`: the weight loaders
``narrow``/``split`` them as usual, and only this rank's window is read from the file when it
is copied into the parameter.

A parameter filled whole from a tensor the checkpoint reader handed over (see :func:`shareable`)
takes that tensor's memory instead of a copy (:func:`share_or_copy`). For safetensors that memory
is the file's private, copy-on-write mapping, so the weights are the page cache's pages, as in
llama.cpp: loading a 0.5B fp32 model then touches 1 GB less fresh memory, which is what start-up
waits on in a VM that backs guest pages lazily (see `worker/cpu_allocator.py`); measured on the
2-core development VM, the constructor went from 4.6-8.6 s to 3.1-3.4 s. Writes to such a
parameter stay private to the process. As with llama.cpp's mmap, rewriting the checkpoint file in
place while the engine runs is not supported (a truncated file faults on access);
`FERROLLM_SHARE_CHECKPOINT_MEMORY=0` copies everything.
"""

from __future__ import annotations

import os
import weakref

import torch
from torch import nn

from ferrollm.exceptions import CheckpointError

__all__ = ["LazyTensor", "check_shape", "copy_weight", "default_weight_loader", "file_mapped", "is_file_mapped",
           "is_shareable", "materialize", "share_or_copy", "shareable"]

# Set on tensors nobody else holds or writes: a checkpoint reader's fresh or file-mapped tensors.
_SHAREABLE = "_ferrollm_shareable"
# Storage base address -> True, for the storages of live tensors a reader marked `file_mapped`.
_MAPPED: dict[int, bool] = {}


class LazyTensor:
    """A tensor of a safetensors file, not read yet.

    ``narrow``, ``split``, ``chunk`` and ``t`` only move a window over the stored tensor; anything
    else (and copying into a parameter) reads the window. Weight loaders written for real tensors
    work unchanged, and a rank reads only the slices it keeps.

    Args:
        handle: ``safe_open(...).get_slice(name)``; indexing it with slices reads them.
        shape: the stored shape.
    """

    def __init__(self, handle, shape: tuple[int, ...], perm: tuple[int, ...] | None = None,
                 ranges: list[tuple[int, int]] | None = None):
        self._handle = handle
        self._perm = perm if perm is not None else tuple(range(len(shape)))
        self._ranges = ranges if ranges is not None else [(0, n) for n in shape]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._ranges[d][1] - self._ranges[d][0] for d in self._perm)

    @property
    def ndim(self) -> int:
        return len(self._perm)

    def dim(self) -> int:
        return len(self._perm)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.shape[0]

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        dim %= self.ndim
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside a tensor of shape {tuple(self.shape)}")
        stored = self._perm[dim]
        ranges = list(self._ranges)
        first = ranges[stored][0] + start
        ranges[stored] = (first, first + length)
        return LazyTensor(self._handle, (), self._perm, ranges)

    def split(self, split_size, dim: int = 0) -> tuple[LazyTensor, ...]:
        total = self.shape[dim]
        sizes = list(split_size) if not isinstance(split_size, int) else \
            [min(split_size, total - i) for i in range(0, total, split_size)]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, start, n) for start, n in zip(starts, sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[LazyTensor, ...]:
        return self.split(-(-self.shape[dim] // chunks), dim)

    def t(self) -> LazyTensor:
        if self.ndim != 2:
            return self.materialize().t()
        return LazyTensor(self._handle, (), (self._perm[1], self._perm[0]), list(self._ranges))

    def materialize(self) -> torch.Tensor:
        """Reads the window from the file."""
        data = self._handle[tuple(slice(a, b) for a, b in self._ranges)] if self._ranges else self._handle[...]
        return data.permute(self._perm) if self._perm != tuple(sorted(self._perm)) else data

    def __getattr__(self, name: str):
        # Any other tensor method reads the window and applies to the real tensor.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __iter__(self):
        return iter(self.materialize())

    def __getitem__(self, index):
        return self.materialize()[index]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x.materialize() if isinstance(x, LazyTensor) else x

        return func(*[real(a) for a in args], **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)})"


def materialize(t: torch.Tensor | LazyTensor) -> torch.Tensor:
    """``t`` as a real tensor (reads a :class:`LazyTensor`'s window)."""
    return t.materialize() if isinstance(t, LazyTensor) else t


def check_shape(expected: tuple[int, ...], src: torch.Tensor, what: str = "weight") -> None:
    """Raises unless ``src`` has shape ``expected``.

    Raises:
        CheckpointError: naming ``what`` and both shapes.
    """
    if tuple(src.shape) != tuple(expected):
        raise CheckpointError(
            f"{what}: the checkpoint tensor has shape {tuple(src.shape)}, the model expects "
            f"{tuple(expected)}; does config.json match the weights?"
        )


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str = "weight") -> None:
    """Copies ``src`` into ``dst`` (casting dtype) after checking the shapes agree.

    Args:
        dst: the parameter, or the slice of it, to fill.
        src: the checkpoint tensor, or the slice of it, for this rank.
        what: how to name the tensor in the error.

    Raises:
        CheckpointError: if the shapes differ.
    """
    check_shape(dst.shape, src, what)
    with torch.no_grad():
        dst.copy_(materialize(src))


def shareable(t: torch.Tensor) -> torch.Tensor:
    """Marks a tensor a checkpoint reader hands over for keeps: a parameter filled whole from it
    may hold its memory instead of a copy. Returns ``t``."""
    setattr(t, _SHAREABLE, True)
    return t


def file_mapped(t: torch.Tensor) -> torch.Tensor:
    """Marks a checkpoint reader's view of a read-only file mapping: like :func:`shareable`, and
    also for its views (a rank's rows, one of q/k/v), while the tensor lives; their pages may be
    handed back after a copy (`cpu_weights.release_pages`). Returns ``t``."""
    shareable(t)
    base = t.untyped_storage().data_ptr()
    _MAPPED[base] = True
    weakref.finalize(t, _MAPPED.pop, base, None)
    return t


def is_file_mapped(t: torch.Tensor) -> bool:
    """Whether ``t`` views the storage of a live :func:`file_mapped` tensor."""
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().data_ptr() in _MAPPED


def is_shareable(t: torch.Tensor) -> bool:
    """Whether a layer may keep ``t``'s memory instead of a copy (`FERROLLM_SHARE_CHECKPOINT_MEMORY=0`
    says never)."""
    if os.environ.get("FERROLLM_SHARE_CHECKPOINT_MEMORY", "1") == "0":
        return False
    # A view (one of q/k/v, a rank's rows) of a marked tensor counts as the tensor.
    return (getattr(t, _SHAREABLE, False) or getattr(getattr(t, "_base", None), _SHAREABLE, False)
            or is_file_mapped(t))


def share_or_copy(param: nn.Parameter, src: torch.Tensor, what: str = "weight") -> None:
    """Fills all of ``param`` from ``src``: by taking ``src``'s memory when it was marked
    :func:`shareable` and matches the parameter's device, dtype and shape and is contiguous,
    else by copying.

    Raises:
        CheckpointError: if the shapes differ.
    """
    if not _can_share(param, src):
        return copy_weight(param.data, src, what)
    check_shape(param.shape, src, what)
    with torch.no_grad():
        param.set_(src)


def _can_share(param: nn.Parameter, src: torch.Tensor) -> bool:
    return (is_shareable(src) and src.device == param.device and src.dtype == param.dtype
            and src.is_contiguous())


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    """Loader of parameters that are not sharded: the whole tensor (see :func:`share_or_copy`).

    Args:
        param: the parameter.
        loaded_weight: the checkpoint tensor.
    """
    share_or_copy(param, loaded_weight)
