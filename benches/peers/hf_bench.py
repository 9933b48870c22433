"""HF transformers on the side-by-side workloads: ``generate`` on left-padded batches, in ``--dtype``
(fp32 by default; a GGUF is dequantized to it), on ``--device`` (cpu by default, or cuda).

A user batches with transformers by padding prompts on the left and generating up to the longest
output the batch asks for; every request in a batch runs until the batch ends, and only the
tokens each request asked for are counted. EOS is ignored by a generation config whose
``eos_token_id`` is ``[]`` (``min_new_tokens`` would mask EOS in the logits instead, which costs
work the engines do not do).

    .venv/bin/python benches/peers/hf_bench.py --model .bench/qwen2-0.5b \
        --requests-dir .bench/requests --workloads startup,fixed [--batch-size 32] [--dtype bfloat16]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Request, parser, run  # noqa: E402


class HfEngine:
    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(args.threads)
        path = Path(args.model)
        kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        folder = path.parent if path.suffix == ".gguf" else path
        self.device = torch.device(args.device)
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype), **kwargs)
        self.model = self.model.to(self.device).eval()
        self.batch_size = args.batch_size
        self.temperature = args.temperature
        self.pad_id = 0
        torch.manual_seed(args.seed)

    def _generate_batch(self, requests: list[Request]) -> list[int]:
        import torch
        from transformers import GenerationConfig

        width = max(len(r.prompt_token_ids) for r in requests)
        ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            n = len(r.prompt_token_ids)
            ids[i, width - n:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - n:] = 1
        max_new = max(r.output_len for r in requests)
        sampling = {"do_sample": True, "temperature": self.temperature} if self.temperature > 0 else {"do_sample": False}
        config = GenerationConfig(max_new_tokens=max_new, top_p=1.0, top_k=None, eos_token_id=[],
                                  pad_token_id=self.pad_id, **sampling)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      generation_config=config)
        generated = out.shape[1] - width
        return [min(r.output_len, generated) for r in requests]

    def generate(self, requests: list[Request]) -> list[int]:
        produced: list[int] = []
        for start in range(0, len(requests), self.batch_size):
            produced += self._generate_batch(requests[start:start + self.batch_size])
        return produced


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--batch-size", type=int, default=32, help="requests per generate() call")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="torch dtype the weights are loaded in and computed with")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    args = p.parse_args()
    import torch
    import transformers

    run("hf", lambda: HfEngine(args), args,
        {"version": transformers.__version__, "torch": torch.__version__, "batch_size": args.batch_size,
         "dtype": args.dtype})


if __name__ == "__main__":
    main()
