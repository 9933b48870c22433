"""Makes and caches the quantized files of the quantized side-by-side (``side_by_side.py --quant``).

From the Qwen2-0.5B-shaped fp32 checkpoint (benches/make_checkpoint.py), each with the format's
own tool, so neither engine is measured on a file the other side wrote:

- ``qwen2-0.5b-f32.gguf``: llama.cpp's ``convert_hf_to_gguf.py`` from the llama-cpp-python sdist
  (run by this interpreter, with the tree's own ``gguf-py`` and, for the SentencePiece copy of the
  word-level tokenizer that benches/peers/spm_tokenizer.py writes, ``sentencepiece`` and
  ``protobuf`` installed under ``<bench-dir>/convert-libs``: the project's venv carries neither);
- ``qwen2-0.5b-q8_0.gguf``, ``qwen2-0.5b-q4_0.gguf``: llama.cpp's quantizer on the f32 GGUF
  (benches/peers/gguf_quantize.py, in llama.cpp's venv). llama.cpp keeps norms and biases in f32
  and, for Q4_0, puts the tied 151936 x 896 embedding in Q8_0 (its Q6_K choice does not fit a row
  of 896);
- ``qwen2-0.5b-ct-w8a8``, ``qwen2-0.5b-ct-w4a16``: compressed-tensors folders written by
  compressed-tensors itself (tests/helpers/quant_checkpoints.py ``write_compressed_tensors``):
  W8A8 int8 per-channel weights with dynamic per-token int8 activations, W4A16 symmetric int4 in
  groups of 128 with its scales rounded to fp16 values (as GPTQ files, and compressed-tensors
  files of fp16 or bf16 models, hold them: what lets ferrollm run them as Q4_0 blocks,
  `quantization.int_blocks`); ``lm_head`` ignored, so the tied embedding stays fp32, as the
  checkpoint is.

Every file is written under a temporary name and renamed into place, so an interrupted run leaves
nothing half-written; a file already there is kept. The compressed-tensors pass holds the fp32
model three times (model, reference copy, compressor): ~6 GB for a minute.

    .venv/bin/python benches/quant_files.py [--bench-dir .bench] [ct-w8a8 gguf-q4_0 ...]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_TREE = "src/llama_cpp_python-0.3.36/vendor/llama.cpp"
CONVERT_LIBS = ("sentencepiece>=0.1.98,<0.3.0", "protobuf>=4.21.0,<5.0.0")  # the converter's pins
CT_SCHEMES = {"ct-w8a8": "W8A8", "ct-w4a16": "W4A16"}
GGUF_TYPES = ("q8_0", "q4_0", "bf16")
CT_GROUP_SIZE = 128
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def checkpoint(bench_dir: Path) -> Path:
    return bench_dir / "qwen2-0.5b"


def quant_path(bench_dir: Path, name: str) -> Path:
    """Where the file of a variant named ``gguf-q8_0``, ``ct-w8a8``, ... lives."""
    if name.startswith("gguf-"):
        return bench_dir / f"qwen2-0.5b-{name[5:]}.gguf"
    return bench_dir / f"qwen2-0.5b-{name}"


def _run(cmd: list[str], log: Path, env: dict | None = None) -> None:
    import os

    print(f"  $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=out, stderr=out, env={**os.environ, **(env or {})}, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd[:3])} ... (log: {log})")


def f32_gguf(bench_dir: Path, log: Path) -> Path:
    """llama.cpp's f32 GGUF of the checkpoint (what benches/peers/setup.sh gguf makes, without
    installing the converter's requirements into llama.cpp's venv)."""
    dst = bench_dir / "qwen2-0.5b-f32.gguf"
    if dst.exists():
        return dst
    tree, libs = bench_dir / LLAMA_TREE, bench_dir / "convert-libs"
    if not (libs / "sentencepiece").exists():
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(libs), *CONVERT_LIBS], log)
    conv = bench_dir / "qwen2-0.5b-for-gguf"  # the weights linked, a SentencePiece tokenizer beside
    conv.mkdir(exist_ok=True)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        link, src = conv / name, checkpoint(bench_dir) / name
        if src.exists() and not link.exists():
            link.symlink_to(src.resolve())
    _run([sys.executable, str(REPO / "benches" / "peers" / "spm_tokenizer.py"), str(checkpoint(bench_dir)), str(conv)], log)
    tmp = dst.with_name(dst.name + ".tmp")
    _run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(conv), "--outtype", "f32", "--outfile", str(tmp)],
         log, {"PYTHONPATH": f"{tree / 'gguf-py'}:{libs}"})
    tmp.replace(dst)
    return dst


def quantized_gguf(bench_dir: Path, ftype: str, threads: int, log: Path) -> Path:
    """The checkpoint as a ``ftype`` (q8_0, q4_0, bf16) GGUF, made by llama.cpp's quantizer."""
    dst = quant_path(bench_dir, f"gguf-{ftype}")
    if not dst.exists():
        src = f32_gguf(bench_dir, log)
        _run([str(bench_dir / "venv-llamacpp" / "bin" / "python"), str(REPO / "benches" / "peers" / "gguf_quantize.py"),
              str(src), str(dst), "--ftype", ftype, "--threads", str(threads)], log)
    return dst


def compressed_tensors(bench_dir: Path, name: str, log: Path) -> Path:
    """The checkpoint as a compressed-tensors folder (``ct-w8a8`` or ``ct-w4a16``), written in a
    process of its own so the ~6 GB it holds goes back before any engine runs."""
    dst = quant_path(bench_dir, name)
    if not dst.exists():
        _run([sys.executable, __file__, "--bench-dir", str(bench_dir), "--write-ct", name], log)
    return dst


def _write_ct(bench_dir: Path, name: str) -> None:
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from tests.helpers.quant_checkpoints import write_compressed_tensors

    src, dst = checkpoint(bench_dir), quant_path(bench_dir, name)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    write_compressed_tensors(model, CT_SCHEMES[name], tmp, group_size=CT_GROUP_SIZE, fp16_scales=name == "ct-w4a16")
    for file in TOKENIZER_FILES:
        if (src / file).exists():
            shutil.copy(src / file, tmp / file)
    tmp.replace(dst)


def make(bench_dir: Path, name: str, threads: int, log: Path) -> Path:
    """The file of variant ``name`` (``gguf-<type>`` or ``ct-<scheme>``), made if missing."""
    if name.startswith("gguf-"):
        return quantized_gguf(bench_dir, name[5:], threads, log)
    if name in CT_SCHEMES:
        return compressed_tensors(bench_dir, name, log)
    raise ValueError(f"no quantized file for {name!r}: gguf-{{{','.join(GGUF_TYPES)}}} or {', '.join(CT_SCHEMES)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", default=[f"gguf-{t}" for t in GGUF_TYPES] + list(CT_SCHEMES))
    p.add_argument("--bench-dir", type=Path, default=REPO / ".bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--write-ct", choices=tuple(CT_SCHEMES), help=argparse.SUPPRESS)  # the child process
    args = p.parse_args()
    if args.write_ct:
        _write_ct(args.bench_dir, args.write_ct)
        return
    log = args.bench_dir / "logs" / "quant_files.log"
    for name in args.names:
        print(f"{name}: {make(args.bench_dir, name, args.threads, log)}", flush=True)


if __name__ == "__main__":
    main()
