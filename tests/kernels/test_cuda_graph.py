"""The CUDA-graph decode runner: refused off CUDA; on a GPU, replays match eager steps.

The GPU test runs the Triton kernels compiled, so run it in its own session:
``TRITON_INTERPRET=0 pytest -m gpu tests/kernels``.
"""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (sets TRITON_INTERPRET unless the caller did)
import numpy as np
import pytest
import torch
from helpers.engine_driver import build_checkpoint, load_ferrollm_model, make_prompts
from triton import knobs

from ferrollm import EngineCore, SamplingOptions
from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache
from ferrollm.config import CompilationConfig
from ferrollm.exceptions import ConfigError
from ferrollm.worker.cuda_graph import CudaGraphRunner

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or knobs.runtime.interpret,
                               reason="needs a CUDA device and TRITON_INTERPRET=0")


def test_cuda_graphs_are_refused_off_cuda():
    config = CompilationConfig()
    config.init_capture_sizes(max_num_seqs=8, max_num_batched_tokens=256)
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device. Given: cpu"):
        CudaGraphRunner(torch.nn.Identity(), [], config, block_size=16, max_model_len=128, device="cpu")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replayed_decode_steps_match_eager_steps(tmp_path, dtype):
    device = torch.device("cuda")
    build_checkpoint("llama", tmp_path)
    model = load_ferrollm_model(tmp_path, dtype, device)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    kv_caches = allocate_kv_cache(num_layers, 64, 16, num_kv_heads, head_dim, dtype, device)
    config = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8])
    config.init_capture_sizes(max_num_seqs=6, max_num_batched_tokens=256)
    graphs = CudaGraphRunner(model, kv_caches, config, block_size=16, max_model_len=128, device=device)
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4, 8]

    core = EngineCore(block_size=16, num_blocks=64, max_model_len=128, max_num_seqs=6)
    params = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(6, seed=0, vocab=384, min_len=3, max_len=40)
    core.add_requests([str(i) for i in range(6)], prompts, [params] * 6)
    replayed = 0
    with torch.inference_mode():
        while core.has_unfinished_requests():
            step = core.schedule()
            meta = AttentionMetadata.from_step(step, 16, device)
            input_ids = torch.from_numpy(step.input_ids).to(device)
            positions = torch.from_numpy(step.positions).to(device)
            eager = model(input_ids, positions, kv_caches, meta)
            hidden = graphs.execute(input_ids, positions, meta)
            if meta.is_decode_only:
                assert hidden is not None and hidden.shape == eager.shape
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(hidden, eager, atol=tol, rtol=tol)
                replayed += 1
            else:
                assert hidden is None
            logits = model.compute_logits(eager[torch.from_numpy(step.logits_indices).to(device)])
            core.update(logits.argmax(-1).cpu().numpy().astype(np.int64))
    assert replayed >= 10
