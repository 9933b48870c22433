"""The vision encoder's worst step for the GPU start-up profile (built and run here on the CPU)."""

from __future__ import annotations

import torch
from ferrollm.model_executor.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration
from ferrollm.worker.encoder_profile import encoder_worst_case, run_encoder_worst_case
from ferrollm.worker.gpu_profiler import MemoryProfile
from helpers.vl_checkpoints import vl_config


def test_worst_case_fills_the_budget_with_the_largest_image():
    grids = encoder_worst_case(encoder_budget=100, tokens_per_item=32, merge=2)
    assert len(grids) == 3
    assert all(t * h * w // 4 <= 32 for t, h, w in grids)
    assert encoder_worst_case(100, 0, 2) == []


def test_worst_case_runs_through_the_encoder():
    ids = {"<|image_pad|>": 380, "<|video_pad|>": 381, "<|vision_start|>": 382, "<|vision_end|>": 383}
    model = Qwen2_5_VLForConditionalGeneration(vl_config("qwen2_5_vl", ids))
    with torch.inference_mode():
        what = run_encoder_worst_case(model, 64, 32, torch.device("cpu"))
    assert what == "2 image(s) of 10x12 patches"  # 5 x 6 merged tokens each


def test_profile_log_names_the_encoder_run():
    profile = MemoryProfile(total=1 << 30, in_use=0, activation_peak=0, graphs=0, non_torch=0,
                            encoder_profiled="2 image(s) of 10x6 patches")
    assert "vision encoder on 2 image(s)" in profile.describe(0.9)
