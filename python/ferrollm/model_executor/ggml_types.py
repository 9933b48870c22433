"""GGML tensor types: name, elements per block and bytes per block, from the GGUF format's
specification, for the types ferrollm reads or keeps. Others are looked up in gguf-py.

Why a table of our own: importing gguf-py costs ~0.3 s of start-up (its package imports its
metadata and vocabulary helpers), and reading a GGUF file's tensor table needs only these sizes.
"""

from __future__ import annotations

__all__ = ["block_size", "type_name"]

# id: (name, elements per block, bytes per block)
_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}


def block_size(ggml_type: int) -> tuple[int, int]:
    """``(elements, bytes)`` of one block of ``ggml_type``.

    Raises:
        ValueError: a type neither this table nor gguf-py knows.
    """
    if ggml_type in _TYPES:
        return _TYPES[ggml_type][1:]
    import gguf

    try:
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (KeyError, ValueError):
        raise ValueError(f"GGML type {ggml_type} is not one gguf-py knows") from None


def type_name(ggml_type: int) -> str:
    """``ggml_type``'s name (``Q4_K``), or ``type <id>`` for one gguf-py does not know either."""
    if ggml_type in _TYPES:
        return _TYPES[ggml_type][0]
    import gguf

    try:
        return gguf.GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"
