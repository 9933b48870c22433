"""vLLM (CPU build) on the side-by-side workloads: offline ``LLM.generate`` with ``ignore_eos``.

Run with .bench/venv-vllm's interpreter; prints one JSON line (see common.py).

    .bench/venv-vllm/bin/python benches/peers/vllm_bench.py --model .bench/qwen2-0.5b \
        --requests-dir .bench/requests --workloads startup,fixed
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Request, generate_offline, parser, run  # noqa: E402


class VllmEngine:
    def __init__(self, args):
        from vllm import LLM

        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       block_size=args.block_size, seed=args.seed, enforce_eager=args.enforce_eager,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
        self.temperature = args.temperature

    def generate(self, requests: list[Request]) -> list[int]:
        from vllm import SamplingParams

        return generate_offline(self.llm, SamplingParams, requests, self.temperature)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--block-size", type=int, default=32, help="the CPU backend needs a multiple of 32")
    p.add_argument("--kvcache-space-gib", type=int, default=4)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = p.parse_args()
    # Both cores for the model (by default vLLM keeps one for its scheduler); set before import.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kvcache_space_gib))
    import vllm

    run("vllm", lambda: VllmEngine(args), args,
        {"version": vllm.__version__, "dtype": args.dtype, "block_size": args.block_size,
         "enforce_eager": args.enforce_eager})


if __name__ == "__main__":  # vLLM spawns workers: the guard keeps them from re-running the benchmark
    main()
