"""The tiny random Qwen2.5-VL of the tests through ferrollm and transformers: images per second
through the vision encoder (one batched call over all images, each engine's own encoder) and
output tokens per second through `generate` (ferrollm: all requests in one `LLM.generate`;
transformers: one request at a time, batch 1, since its batched VL generate needs padding).

    PYTHONPATH=python:tests python benches/mm_tiny.py [--images 32] [--requests 8] [--tokens 32]

The model is tiny (2 layers of 64 wide, a 2-block 32-wide encoder), so the figures measure the
engines' per-step overheads far more than arithmetic.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from conftest import build_tokenizer_dir
from ferrollm import LLM, SamplingParams
from helpers.vl_checkpoints import (
    build_vl_checkpoint,
    hf_greedy_vl,
    image_processor,
    random_image,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def _best(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    folder = tmp / "qwen2_5_vl"
    hf = build_vl_checkpoint("qwen2_5_vl", folder, build_tokenizer_dir(tmp / "tok"))
    images = [random_image(i, 140, 140) for i in range(args.images)]
    batch = image_processor()(images=images, return_tensors="pt")
    grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
    llm = LLM(str(folder), max_model_len=512)
    ours = llm.llm_engine.generation_runner.model
    with torch.inference_mode():
        t_ours = _best(lambda: ours.encode_images(batch["pixel_values"], grids))
        t_hf = _best(lambda: hf.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]))
    print(f"encoder ({args.images} images of {grids[0]} patches): ferrollm {args.images / t_ours:.0f} images/s, "
          f"transformers {args.images / t_hf:.0f} images/s")
    prompts = [{"prompt": f"request {i} {IMAGE} describe", "multi_modal_data": {"image": images[i % len(images)]}}
               for i in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    t_gen = time.perf_counter() - start
    tok = llm.llm_engine.tokenizers.core
    start = time.perf_counter()
    for p in prompts:
        hf_greedy_vl(hf, tok.encode(p["prompt"]), [p["multi_modal_data"]["image"]], args.tokens)
    t_hf_gen = time.perf_counter() - start
    n = args.requests * args.tokens
    print(f"generate ({args.requests} requests x {args.tokens} tokens, one image each): ferrollm {n / t_gen:.0f} "
          f"tok/s, transformers (batch 1) {n / t_hf_gen:.0f} tok/s")
    llm.close()


if __name__ == "__main__":
    main()
