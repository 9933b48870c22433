#!/usr/bin/env bash
# The GPU run of issue #24, on a machine with one CUDA GPU, from the repository root, with the
# built extension (python/ferrollm/_core.abi3.so) in the tree. Logs and JSON go to $OUT (default
# ./gpu-out). Each step has its own timeout, so one hang does not eat the run.
#
#   bash benches/gpu_run.sh tests      # the gpu-marked tests: kernels, then the engine on cuda
#   bash benches/gpu_run.sh bench      # side_by_side: startup, mixed, fixed, latency vs HF, bf16
#   bash benches/gpu_run.sh nanovllm   # nano-vllm's shape: 256 seqs, in/out 100-1023
#   bash benches/gpu_run.sh models     # quantized and multimodal models on cuda
#   bash benches/gpu_run.sh kernels-quant  # the quantized Triton kernels against their references
#   bash benches/gpu_run.sh gguf       # GGUF blocks as integer forms on Triton: the kernels, then a tiny file
#   bash benches/gpu_run.sh quant      # gpu_quant.py: quantized against bf16, 0.5B and 3B shapes
#   bash benches/gpu_run.sh cpu        # the host CPU's bf16/AMX flags, and the Rust kernel tests on it
#                                      # (.devbin/kernels-tests: `cargo test -p ferrollm-kernels
#                                      # --release --no-run`'s binary, copied there; it needs no Rust)
#
# Several modes run one after the other: `bash benches/gpu_run.sh models quant`.
# Optional: wheels of missing pure-Python packages in .gpuwhl/ are installed to /tmp/site first.
set -o pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
if ls .gpuwhl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpuwhl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
BENCH=/tmp/bench
step() {  # step NAME SECONDS CMD...: runs CMD with a timeout, its output in $OUT/NAME.log
    local name=$1 secs=$2; shift 2
    echo "=== $name (timeout ${secs}s): $*"
    local t0=$SECONDS
    timeout "$secs" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
}

[ $# -gt 0 ] || set -- tests
for MODE in "$@"; do
case $MODE in
tests)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/gpu.txt"
    step kernels 300 $PY -m pytest -q -m gpu tests/kernels -p no:cacheprovider -rfE
    step engine 420 $PY -m pytest -q -m gpu tests/e2e/test_gpu.py -p no:cacheprovider -rfE --durations=8
    ;;
bench)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    step checkpoint 180 $PY benches/make_checkpoint.py $BENCH/qwen2-0.5b --dtype bfloat16
    step bench 480 $PY benches/side_by_side.py --device cuda --dtype bfloat16 --engines ferrollm,hf \
        --workloads startup,mixed,fixed,latency --bench-dir $BENCH --out "$OUT/side_by_side-cuda.json"
    cp $BENCH/logs/*.log "$OUT/" 2>/dev/null
    ;;
nanovllm)
    [ -f $BENCH/qwen2-0.5b/model.safetensors ] || step checkpoint 180 $PY benches/make_checkpoint.py $BENCH/qwen2-0.5b --dtype bfloat16
    step nanovllm 300 $PY benches/side_by_side.py --device cuda --dtype bfloat16 --engines ferrollm \
        --workloads nanovllm --max-model-len 4096 --bench-dir $BENCH --out "$OUT/nanovllm-cuda.json"
    step nanovllm_hf ${HF_TIMEOUT:-240} $PY benches/side_by_side.py --device cuda --dtype bfloat16 --engines hf \
        --workloads nanovllm --max-model-len 4096 --hf-batch-size 256 --skip-roofline --bench-dir $BENCH \
        --out "$OUT/nanovllm-hf-cuda.json"
    ;;
models)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
    step models 240 $PY -m pytest -q -m gpu tests/e2e/test_gpu_quantized.py tests/e2e/test_gpu_multimodal.py \
        -p no:cacheprovider -rfE --durations=8
    ;;
kernels-quant)
    step kernels_quant 150 $PY -m pytest -q -m gpu tests/kernels/test_triton_quant.py -p no:cacheprovider -rfE
    ;;
gguf)
    step kernels_gguf 90 $PY -m pytest -q -m gpu tests/kernels/test_gguf_int_forms.py -p no:cacheprovider -rfE
    # GGUF projections as weight-only integers on the Triton kernels, a tiny mixed-type file against the CPU.
    step gguf 120 $PY -m pytest -q -m gpu tests/e2e/test_gpu_gguf.py -p no:cacheprovider -rfE --durations=4
    ;;
quant)
    step gpu_quant_3b 240 $PY benches/gpu_quant.py --bench-dir $BENCH --model qwen2.5-3b --variants bf16,fp8,int8,rtn4 \
        --out "$OUT/gpu_quant_3b.json"
    step checkpoint 45 $PY benches/make_checkpoint.py $BENCH/qwen2-0.5b --dtype bfloat16
    step gpu_quant 110 $PY benches/gpu_quant.py --bench-dir $BENCH --variants bf16,fp8,int8,rtn4,ct-w4a16 \
        --out "$OUT/gpu_quant.json"
    ;;
cpu)
    # The machine lending the GPU has a larger CPU, often with AVX512-BF16 and AMX, which the
    # development machine lacks: the bf16 GEMM's native paths are tested here.
    { grep -m1 'model name' /proc/cpuinfo; nproc
      grep -m1 -o -w -E 'avx512_bf16|amx_bf16|amx_tile|avx512_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
    } | tee "$OUT/cpu.txt"
    step cpu_kernels 240 .devbin/kernels-tests --test-threads 8
    step cpu_gemm_bf16 150 $PY benches/cpu_gemm.py --dtype bfloat16 --rows 1,32,128 --threads "$(nproc)" --layers 4 \
        --bf16-loops amx,avx512_bf16
    # CUDA hidden: on this machine the engine's device="auto" would pick the GPU.
    CUDA_VISIBLE_DEVICES= step cpu_bf16_tests 200 $PY -m pytest -q tests/kernels/test_gemm_bf16.py tests/models/test_bf16.py \
        tests/e2e/test_cpu_decoder.py -p no:cacheprovider -rfE
    ;;
*)
    echo "unknown mode $MODE (tests, bench, nanovllm, models, kernels-quant, gguf, quant, cpu)"; exit 2 ;;
esac
done
