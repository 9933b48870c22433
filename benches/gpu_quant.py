"""Quantized weights on a GPU, in one run: a checkpoint in bf16 beside its quantized forms
(dynamic ``quantization="fp8"``, ``"int8"`` and ``"rtn"`` 4-bit, compressed-tensors W8A8 and W4A16
folders), every run in bf16 activations with CUDA graphs.

Models: ``qwen2-0.5b`` (benches/make_checkpoint.py's folder; the compressed-tensors variants are
written from it by benches/quant_files.py with compressed-tensors' own writer) and ``qwen2.5-3b``
(Qwen2.5-3B's shape with ``load_format="dummy"`` weights, no files but config.json, so the
dynamic variants only): at 0.5B a decode step is bound by kernel launches, at 3B the weight
bytes start to count.

Figures per variant: batch-1 decode (one 32-token prompt, 256 greedy tokens, tokens per second
of the decode after the first token) beside its bound (the weight bytes over the HBM read
bandwidth, benches/roofline.py), a batched run (64 prompts of 128 tokens, 128 tokens each,
output tokens per second) and the GPU memory the weights hold (the start-up profile's "weights
and other tensors"). The peer is the bf16 run of the same checkpoint in the same process.

    python benches/gpu_quant.py --bench-dir /tmp/bench [--model qwen2.5-3b] [--variants bf16,fp8,int8,rtn4]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import make_checkpoint
import quant_files
import roofline

# name -> (engine keyword arguments, environment)
VARIANTS = {"bf16": ({}, {}), "fp8": ({"quantization": "fp8"}, {}), "int8": ({"quantization": "int8"}, {}),
            "rtn4": ({"quantization": "rtn"}, {"RTN_NUM_BITS": "4", "RTN_GROUP_SIZE": "128"}),
            "ct-w8a8": ({}, {}), "ct-w4a16": ({}, {})}
MODELS = ("qwen2-0.5b", "qwen2.5-3b")
MIB = 1 << 20


def model_path(bench_dir: Path, model: str, variant: str) -> tuple[Path, dict]:
    """The folder a variant reads and the engine arguments its model needs."""
    if model == "qwen2.5-3b":
        return _dummy_3b(bench_dir), {"load_format": "dummy"}
    if variant in quant_files.CT_SCHEMES:
        return quant_files.make(bench_dir, variant, 8, bench_dir / "logs" / "quant_files.log"), {}
    return quant_files.checkpoint(bench_dir), {}


def _dummy_3b(bench_dir: Path) -> Path:
    from transformers import Qwen2Config

    folder = bench_dir / "qwen2.5-3b-dummy"
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        Qwen2Config(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                    intermediate_size=11008, vocab_size=make_checkpoint.VOCAB, max_position_embeddings=32768,
                    tie_word_embeddings=True, rope_theta=1000000.0, eos_token_id=2, bos_token_id=1,
                    dtype="bfloat16", architectures=["Qwen2ForCausalLM"]).save_pretrained(folder)
        make_checkpoint.write_tokenizer(folder)
    return folder


def measure(path: Path, engine_kw: dict, env: dict) -> dict:
    import os

    import torch

    from ferrollm import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 150000, (128,), generator=g).tolist()} for _ in range(64)]
    one = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:32]}]
    os.environ.update(env)
    try:
        llm = LLM(model=str(path), device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=64,
                  **engine_kw)
    finally:
        for key in env:
            os.environ.pop(key)
    with llm:
        weights = llm.llm_engine.memory_profile.in_use
        llm.generate(one, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        first = _seconds(llm, one, SamplingParams(max_tokens=1, ignore_eos=True))
        total = _seconds(llm, one, SamplingParams(max_tokens=257, ignore_eos=True))
        batched = _seconds(llm, prompts, SamplingParams(max_tokens=128, ignore_eos=True))
    gc.collect()
    torch.cuda.empty_cache()
    return {"weights_mib": weights / MIB, "batch1_tokens_per_s": 256 / (total - first),
            "batched_output_tokens_per_s": 64 * 128 / batched}


def _seconds(llm, prompts, params) -> float:
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bench-dir", type=Path, required=True)
    p.add_argument("--model", choices=MODELS, default=MODELS[0])
    p.add_argument("--variants", default="bf16,fp8,int8,rtn4,ct-w8a8,ct-w4a16")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    import torch

    read = roofline.measure_gpu()["bandwidth"]["read_bytes_per_s"]
    report = {"device": torch.cuda.get_device_name(), "model": args.model, "read_bytes_per_s": read,
              "runs": {}, "errors": {}}
    for name in args.variants.split(","):
        try:
            path, model_kw = model_path(args.bench_dir, args.model, name)
            engine_kw, env = VARIANTS[name]
            report["runs"][name] = measure(path, {**model_kw, **engine_kw}, env)
        except Exception as e:  # one variant failing leaves the others' figures
            report["errors"][name] = f"{type(e).__name__}: {e}"
        print(name, report["runs"].get(name) or report["errors"][name], file=sys.stderr, flush=True)
    print(format_report(report))
    for name, err in report["errors"].items():
        print(f"{name}: {err}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


def format_report(report: dict) -> str:
    base = report["runs"].get("bf16")
    lines = [f"{report['device']}, {report['model']} shape, bf16 activations, CUDA graphs; "
             f"HBM read {report['read_bytes_per_s'] / 1e12:.2f} TB/s",
             "| weights | weight MiB | batch 1 tok/s (bound) | 64 x 128/128 output tok/s |", "|---|---:|---:|---:|"]
    for name, r in report["runs"].items():
        rel = (f" ({r['batched_output_tokens_per_s'] / base['batched_output_tokens_per_s']:.2f}x)"
               if base and name != "bf16" else "")
        bound = report["read_bytes_per_s"] / (r["weights_mib"] * MIB)
        lines.append(f"| {name} | {r['weights_mib']:.0f} | {r['batch1_tokens_per_s']:.0f} ({bound:.0f}) | "
                     f"{r['batched_output_tokens_per_s']:.0f}{rel} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
