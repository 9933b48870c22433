"""ferrollm through the peers' own runner (common.py): offline ``LLM.generate`` with ``ignore_eos``.

side_by_side.py measures ferrollm through ``ferrollm bench``, as a user would; this runner is for
figures that must come from the very same code for every engine, such as memory.py's start-up
and peak RSS of one process that builds the engine, answers a one-token request and then runs a
workload. Run with the project's interpreter; prints one JSON line (see common.py).

    .venv/bin/python benches/peers/ferrollm_bench.py --model .bench/qwen2-0.5b \
        --requests-dir .bench/requests/qwen2-seed0 --workloads startup,memory --temperature 0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Request, generate_offline, parser, run  # noqa: E402


class FerrollmEngine:
    def __init__(self, args):
        from ferrollm import LLM

        extra = {}
        if args.compilation_config is not None:
            level = args.compilation_config
            extra["compilation_config"] = int(level) if level.isdigit() else json.loads(level)
        self.llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                       device=args.device, enforce_eager=args.enforce_eager, **extra)
        self.temperature = args.temperature

    def generate(self, requests: list[Request]) -> list[int]:
        from ferrollm import SamplingParams

        return generate_offline(self.llm, SamplingParams, requests, self.temperature)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--dtype", default="auto", help="ferrollm's `dtype` (auto: fp32 on the CPU)")
    p.add_argument("--device", default="auto", help="ferrollm's `device`: auto, cpu or cuda")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--compilation-config", default=None, help="a level 0-3 or a JSON dict")
    args = p.parse_args()
    # Imported before the clock starts, as the other drivers import torch/transformers and
    # llama_cpp: start-up is the constructor to the first token.
    import ferrollm
    from ferrollm import LLM  # noqa: F401  (imports torch)

    run("ferrollm", lambda: FerrollmEngine(args), args, {"version": ferrollm.__version__, "dtype": args.dtype})


if __name__ == "__main__":
    main()
