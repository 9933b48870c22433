"""Tensor parallelism with ranks started by torchrun: one node or several.

Every process runs this script; each builds the same `LLM` and gets the same outputs (rank 0
samples and shares its draw). On one machine:

    torchrun --nproc-per-node 2 examples/torchrun_tensor_parallel.py --model path/to/checkpoint

On two machines (one rank each), run on both, with node 0's address:

    torchrun --nnodes 2 --nproc-per-node 1 --node-rank {0|1} \\
        --master-addr 10.0.0.1 --master-port 29500 \\
        examples/torchrun_tensor_parallel.py --model path/to/checkpoint
"""

from __future__ import annotations

import argparse
import json
import os

from ferrollm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--prompt", action="append", default=None,
                        help="a prompt (repeatable); default: two sample prompts")
    parser.add_argument("--output-json", default=None, help="write each rank's token ids here ({rank} is replaced)")
    args = parser.parse_args()
    prompts = args.prompt or ["Hello, my name is", "The capital of France is"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with LLM(model=args.model, tensor_parallel_size=world, distributed_executor_backend="external_launcher",
             max_model_len=args.max_model_len) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    rank = int(os.environ.get("RANK", "0"))
    if args.output_json:
        with open(args.output_json.format(rank=rank), "w") as f:
            json.dump([list(o.outputs[0].token_ids) for o in outputs], f)
    if rank == 0:
        for o in outputs:
            print(f"{o.prompt!r} -> {o.outputs[0].text!r}")


if __name__ == "__main__":
    main()
