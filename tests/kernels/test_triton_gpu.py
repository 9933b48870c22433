"""The Triton kernels compiled for the GPU, against their torch references on the same device.

The rest of tests/kernels runs the same kernels under the interpreter; this file needs them
compiled, so run it in its own session: ``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``.
"""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (sets TRITON_INTERPRET unless the caller did)
import pytest
import torch
from helpers.paged_cases import CASES, build_case
from triton import knobs

from ferrollm.attention import cpu_backend, triton_backend
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.kernels.triton import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
    rotary_embedding,
    rotary_embedding_ref,
    silu_and_mul,
    silu_and_mul_ref,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or knobs.runtime.interpret,
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,head_dim", [((4, 4), 64), ((8, 2), 128), ((6, 2), 80)])
@pytest.mark.parametrize("window,cap", [(None, None), (7, 30.0)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_backend_matches_torch_backend(case, heads, head_dim, window, cap, dtype):
    query, k, v, cache, step, _ = build_case(CASES[case], 16, *heads, head_dim, dtype, seed=0)
    meta = AttentionMetadata.from_step(step, 16, "cuda")
    query, k, v, cache = (t.cuda() for t in (query, k, v, cache))
    reference = cache.clone()
    triton_backend.write_kv(k, v, cache, meta.slot_mapping)
    cpu_backend.write_kv(k, v, reference, meta.slot_mapping)
    assert torch.equal(cache, reference)
    out = triton_backend.paged_attention(query, cache, meta, head_dim**-0.5, window, cap)
    ref = cpu_backend.paged_attention(query, reference, meta, head_dim**-0.5, window, cap)
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_rotary_and_activation_match_references(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

    x, residual, weight = randn(33, 4096), randn(33, 4096), randn(4096)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), **TOL[dtype])
    got = fused_add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    want = fused_add_rms_norm_ref(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(got, want, **TOL[dtype])

    positions = torch.randint(0, 4096, (33,), device="cuda")
    cache = randn(4096, 128)
    q, k = randn(33, 32 * 128), randn(33, 8 * 128)
    q_ref, k_ref = q.clone(), k.clone()
    rotary_embedding(positions, q, k, 128, cache)
    rotary_embedding_ref(positions, q_ref, k_ref, 128, cache)
    torch.testing.assert_close((q, k), (q_ref, k_ref), **TOL[dtype])

    gate_up = randn(33, 2 * 11008)
    torch.testing.assert_close(silu_and_mul(gate_up), silu_and_mul_ref(gate_up), **TOL[dtype])
