"""Load time of a checkpoint at tensor-parallel sizes 1 and 2: the regular safetensors folder
(every rank opens the same files and reads its slices) against the per-rank files of
`LLM.save_sharded_state` (every rank reads only its own files).

    python benches/tp_load.py                      # a random SmolLM2-135M-shaped Llama, fp32
    python benches/tp_load.py --model /path/to/hf-folder --tp 1 2 4

Prints, per format and TP size, the wall time of `LLM(...)` (process start-up, rendezvous,
weights, KV cache) and of the weight loading alone (the slowest rank, as all ranks load at once).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def build_model(folder: Path) -> None:
    import json

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True)
    # 9 heads do not split over 2 ranks: 12 heads of 48 keep the parameter count.
    config.num_attention_heads, config.head_dim, config.num_key_value_heads = 12, 48, 4
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def time_load(model: str, tp: int, load_format: str, repeats: int) -> tuple[float, float]:
    from ferrollm import LLM

    total, weights = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        llm = LLM(model, tensor_parallel_size=tp, load_format=load_format, max_model_len=512, max_num_seqs=4)
        total.append(time.perf_counter() - start)
        weights.append(llm.llm_engine.model_load_seconds)
        llm.generate("t5 t6", use_tqdm=False)
        llm.close()
    return statistics.median(total), statistics.median(weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF checkpoint folder (default: a random 135M Llama, built once)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("FERROLLM_CPU_KVCACHE_SPACE", "0.25")
    work = Path(tempfile.mkdtemp(prefix="ferrollm-tp-load-"))
    model = args.model
    if model is None:
        model = str(work / "model")
        build_model(Path(model))
    size = sum(p.stat().st_size for p in Path(model).glob("*.safetensors")) / 2**20
    print(f"model {model} ({size:.0f} MiB of safetensors), median of {args.repeats}")
    print(f"{'format':<14} {'TP':>3} {'LLM() s':>9} {'weights s':>10}")
    for tp in args.tp:
        from ferrollm import LLM

        sharded = work / f"sharded-tp{tp}"
        with LLM(model, tensor_parallel_size=tp, max_model_len=512, max_num_seqs=4) as llm:
            llm.save_sharded_state(str(sharded))
        for fmt, path in (("safetensors", model), ("sharded_state", str(sharded))):
            total, weights = time_load(path, tp, fmt if fmt == "sharded_state" else "auto", args.repeats)
            print(f"{fmt:<14} {tp:>3} {total:>9.2f} {weights:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
