"""One parse of a llama.cpp GGUF file: its metadata, its tensor table, and its bytes mapped once.

The format (v2 and v3, little-endian): the magic ``GGUF``, a version, the tensor and metadata
counts, the metadata as typed key/value pairs (scalars, strings, arrays of either), the tensor
table (name, dimensions innermost first, GGML type, offset), then the tensors' data from the next
multiple of ``general.alignment`` (32 by default).

gguf-py's ``GGUFReader`` builds a numpy view per value, which made one parse of the 94 MiB SmolLM2
file (49,152 vocabulary strings, 48,900 merges) take 4-7 s on the 2-core development machine, and
the constructor parsed it four times. This reader walks the metadata with ``struct.unpack_from``
over one private (copy-on-write) ``mmap``: ~0.1 s for the same file, strings included. gguf-py
stays the source of the format's constants and the test oracle.

The engine asks for the same file three times (config, tokenizer, the worker's weights), so
:func:`open_gguf` keeps the last file opened: one parse per process. That holds the parsed
vocabulary (~10 MB of Python strings for a 49k vocabulary) for the life of the process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import mmap
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ferrollm.exceptions import CheckpointError

__all__ = ["GGUFFile", "GGUFTensorInfo", "open_gguf"]

logger = logging.getLogger(__name__)

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has not written it since 2023
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# GGUF value type -> struct format of one value.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_SCALARS = {kind: struct.Struct("<" + fmt) for kind, fmt in _SCALAR_FORMATS.items()}
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file.

    Attributes:
        name: llama.cpp's name (``blk.0.attn_q.weight``).
        shape: torch order, outermost dimension first (the file stores innermost first).
        ggml_type: the GGML type id (``gguf.GGMLQuantizationType``).
        offset: the first byte, from the start of the file.
        nbytes: the stored size.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int


class GGUFFile:
    """An open GGUF file: parsed metadata and tensor table, and the file's private mapping.

    Tensor bytes are views of one copy-on-write mapping, so they share the page cache's pages
    and stay valid as long as a view is referenced; nothing needs closing.

    Attributes:
        path: the file.
        metadata: every key, with Python values (``int``, ``float``, ``bool``, ``str`` or lists).
        tensors: the tensor table, in file order.
        metadata_digest: sha256 of the header and metadata bytes: the same for files that
            describe the same model and tokenizer, wherever they are.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = _map_file(self.path)
        try:
            self.metadata, self.tensors, metadata_end = _parse(self._map, len(self._map))
        except (struct.error, UnicodeDecodeError, ValueError) as e:
            raise CheckpointError(f"GGUF file {str(self.path)!r} is not readable: {e}") from e
        self.metadata_digest = hashlib.sha256(memoryview(self._map)[:metadata_end]).hexdigest()
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's stored bytes: a writable ``uint8`` view of the private mapping."""
        return self._bytes[info.offset:info.offset + info.nbytes]


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, from the last call's parse when the file has not changed since.

    Raises:
        CheckpointError: the file cannot be read or is not a GGUF file.
    """
    path = Path(path).resolve()
    try:
        stat = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"cannot read GGUF file {str(path)!r}: {e}") from e
    return _open_cached(path, (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns))


@functools.lru_cache(maxsize=1)
def _open_cached(path: Path, identity: tuple[int, int, int, int]) -> GGUFFile:
    start = time.perf_counter()
    gguf = GGUFFile(path)
    logger.info("GGUF file %s parsed in %.3f s (%d metadata keys, %d tensors)", path.name,
                time.perf_counter() - start, len(gguf.metadata), len(gguf.tensors))
    return gguf


def _map_file(path: Path) -> mmap.mmap:
    try:
        with open(path, "rb") as f:
            # ACCESS_COPY: a private mapping, so the views are writable (torch wants that) and a
            # write stays in this process, as with safetensors' mapped weights.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as e:  # ValueError: an empty file
        raise CheckpointError(f"cannot map GGUF file {str(path)!r}: {e}") from e


def _parse(buf: mmap.mmap, size: int) -> tuple[dict[str, Any], list[GGUFTensorInfo], int]:
    """``(metadata, tensors, end of the metadata)``."""
    if buf[:4] != _MAGIC:
        raise ValueError(f"it starts with {bytes(buf[:4])!r}, not the GGUF magic {_MAGIC!r}")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} is not one of {_VERSIONS}")
    metadata, pos = _read_metadata(buf, 24, num_kv)
    metadata_end = pos
    entries, pos = _read_tensor_table(buf, pos, num_tensors)
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-pos // alignment) * alignment
    tensors = [_tensor_info(name, dims, ggml_type, data_start + offset, size)
               for name, dims, ggml_type, offset in entries]
    return metadata, tensors, metadata_end


def _read_metadata(buf: mmap.mmap, pos: int, count: int) -> tuple[dict[str, Any], int]:
    metadata = {}
    for _ in range(count):
        key, pos = _read_string(buf, pos)
        (kind,) = _U32.unpack_from(buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, kind)
    return metadata, pos


def _read_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, pos)
    pos += 8
    return str(buf[pos:pos + length], "utf-8"), pos + length


def _read_value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    scalar = _SCALARS.get(kind)
    if scalar is not None:
        return scalar.unpack_from(buf, pos)[0], pos + scalar.size
    if kind == _STRING:
        return _read_string(buf, pos)
    if kind != _ARRAY:
        raise ValueError(f"metadata value type {kind} is unknown")
    element, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if element in _SCALAR_FORMATS:
        width = _SCALARS[element].size
        return list(struct.unpack_from(f"<{count}{_SCALAR_FORMATS[element]}", buf, pos)), pos + count * width
    if element == _STRING:
        return _read_strings(buf, pos, count)
    raise ValueError(f"metadata arrays of type {element} are not supported")


def _read_strings(buf: mmap.mmap, pos: int, count: int) -> tuple[list[str], int]:
    # The vocabulary and merges: ~100k strings, so the loop is kept to the bare calls.
    unpack, values = _U64.unpack_from, []
    append = values.append
    for _ in range(count):
        (length,) = unpack(buf, pos)
        pos += 8
        append(str(buf[pos:pos + length], "utf-8"))
        pos += length
    return values, pos


def _read_tensor_table(buf: mmap.mmap, pos: int, count: int) -> tuple[list[tuple[str, tuple[int, ...], int, int]], int]:
    entries = []
    for _ in range(count):
        name, pos = _read_string(buf, pos)
        (num_dims,) = _U32.unpack_from(buf, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    return entries, pos


def _tensor_info(name: str, shape: tuple[int, ...], ggml_type: int, offset: int, size: int) -> GGUFTensorInfo:
    from ferrollm.model_executor.ggml_types import block_size

    try:
        block_len, block_bytes = block_size(ggml_type)
    except ValueError:
        raise ValueError(f"tensor {name!r} has GGML type {ggml_type}, which gguf-py does not know") from None
    numel = int(np.prod(shape, dtype=np.int64))
    if numel % block_len:
        raise ValueError(f"tensor {name!r} of shape {shape} is not whole blocks of {block_len}")
    nbytes = numel // block_len * block_bytes
    if offset + nbytes > size:
        raise ValueError(f"tensor {name!r} runs past the end of the file ({offset + nbytes} > {size} bytes)")
    return GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)
