"""Saves a model as per-rank sharded files that load faster under tensor parallelism.

Each rank writes the parameters it holds (already split and padded) to
``model-rank-{rank}-part-{part}.safetensors`` and the checkpoint's other files are copied next to
them. Load the result at the same tensor-parallel size:

    python examples/save_sharded_state.py --model /path/to/model --tensor-parallel-size 2 \\
        --output /path/to/sharded

    llm = LLM(model="/path/to/sharded", load_format="sharded_state", tensor_parallel_size=2)
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint folder or hub id")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--output", "-o", required=True, help="folder to write the sharded checkpoint to")
    parser.add_argument("--file-pattern", default=None,
                        help="file name with {rank} and {part} fields (default model-rank-{rank}-part-{part}.safetensors)")
    parser.add_argument("--max-file-size", type=int, default=5 * 1024**3,
                        help="largest file in bytes before a rank starts a new part (default 5 GiB)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    return parser.parse_args()


def main() -> None:
    from ferrollm import LLM

    args = parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    with LLM(model=args.model, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype,
             max_model_len=args.max_model_len) as llm:
        llm.save_sharded_state(str(output), pattern=args.file_pattern, max_size=args.max_file_size)
    print(f"saved {args.model} for tensor_parallel_size={args.tensor_parallel_size} to {output}")


if __name__ == "__main__":
    main()
