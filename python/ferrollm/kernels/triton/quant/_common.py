"""What the quantized kernels share: exact rounding and float8 (e4m3fn) conversion in registers,
argument checks, and the choice of tiles.

The e4m3 helpers work on the raw bytes so that the same kernels compile for GPUs without float8
units (before sm_89 Triton refuses the ``float8e4nv`` type outright) and run in the interpreter.
Every e4m3 value is exact in float16 and bfloat16 (4-bit significands, smallest step ``2**-9``),
so decoding loses nothing; encoding rounds to nearest even and saturates at +-448, as
``torch.Tensor.to(torch.float8_e4m3fn)`` does after a clamp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton._utils import check_last_dim_contiguous

FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def round_half_even(y):
    """Rounds float32 ``y`` (|y| < 2**22) to the nearest integer, ties to even.

    Adding 1.5 * 2**23 pushes the fraction out of the significand under the default rounding
    mode. Callers clamp ``y`` first; besides bounding it, the clamp stops the compiler fusing
    the product that made ``y`` into this add (an FMA would round once where torch rounds twice).
    """
    return (y + 12582912.0) - 12582912.0


@triton.jit
def e4m3_encode(y):
    """float32 ``y`` in [-448, 448] -> e4m3fn bit pattern (uint8), rounded to nearest even."""
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # Normal range: keep 3 significand bits of the float32 (ties to even), then move the
    # exponent from bias 127 to bias 7; a carry out of the significand bumps the exponent.
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
    # Below 2**-6 (float32 bits 0x3C800000) e4m3 counts in steps of 2**-9; a count of 8 is the
    # code of 2**-6 itself, so rounding up into the normal range needs no special case.
    subnormal = round_half_even(tl.abs(y) * 512.0).to(tl.uint32)
    return (tl.where(mag < 0x3C800000, subnormal, normal) | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(b):
    """e4m3fn bit pattern (uint8) -> float16, exactly (the NaN codes 0x7F/0xFF read as +-480).

    Placed in a float16's bits, an e4m3 code (sign, 4 exponent, 3 significand bits) reads as
    the value times 2**-8, subnormals included, so one shift and one exact product decode it.
    """
    b16 = b.to(tl.uint16)
    half = ((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)
    return half.to(tl.float16, bitcast=True) * 256.0


def as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """``x`` ``[..., in_features]`` as a 2-D ``[rows, in_features]`` view (copied if it must be)."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"`x` must be float16, bfloat16 or float32. Given: {x.dtype}")
    if x.shape[-1] != in_features:
        raise ValueError(f"the last dimension of `x` must be in_features ({in_features}). Given: {tuple(x.shape)}")
    check_last_dim_contiguous(x=x)
    return x.reshape(-1, in_features)


def check_bias(bias: torch.Tensor | None, out_features: int) -> None:
    if bias is not None and tuple(bias.shape) != (out_features,):
        raise ValueError(f"`bias` must have shape ({out_features},). Given: {tuple(bias.shape)}")


def check_weight(weight: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    if weight.dtype != dtype or tuple(weight.shape) != shape:
        raise ValueError(f"`{name}` must be {dtype} of shape {shape}. Given: {weight.dtype} {tuple(weight.shape)}")
    check_last_dim_contiguous(**{name: weight})


def launch_config(rows: int, block_k: int) -> dict[str, int]:
    """Tile sizes and launch options of a matmul over ``rows`` rows with K tiles of ``block_k``.

    The smallest tl.dot tile (16 rows) covers decode batches, which stream the weight once;
    batches over 64 rows take 128 x 128 tiles and 8 warps. Chosen by a sweep on an H100
    (Triton 3.6, [*, 4096] x [4096, 14336] bfloat16): at 2048 rows the wide tiles took the int8
    matmul from 464 to 217 us and the float8 one from 506 to 410 us, while narrower or deeper
    tiles gained under 10% for one row.
    """
    if rows <= 64:
        return dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=64, BLOCK_K=block_k,
                    num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=block_k, num_warps=8, num_stages=3)


def matmul_grid(rows: int, out_features: int, config: dict[str, int]) -> tuple[int, int]:
    return triton.cdiv(rows, config["BLOCK_M"]), triton.cdiv(out_features, config["BLOCK_N"])


def block_k_within(group: int, limit: int = 128, least: int = 16) -> int:
    """The widest power of two in [least, limit] dividing ``group``, so a K tile never straddles
    two scale groups; ``least`` when none does (the caller has checked ``group``)."""
    block = limit
    while block > least and group % block:
        block //= 2
    return block


def dot_precision(dtype: torch.dtype) -> str:
    """float32 activations get IEEE products (torch's default for float32 matmul), not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def output_like(rows: torch.Tensor, x: torch.Tensor, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[..., out_features]`` result in ``x``'s dtype and its 2-D view."""
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype, device=x.device)
    return out, out.view(rows.shape[0], out_features)
