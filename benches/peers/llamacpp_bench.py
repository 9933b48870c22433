"""llama.cpp (through llama-cpp-python) on the side-by-side workloads.

llama-cpp-python's ``Llama`` object generates one sequence at a time, so batch-1 figures could come
from it, but parallel throughput cannot. Its low-level bindings do expose llama.cpp's
multi-sequence ``llama_batch``/``llama_decode``, which is what llama.cpp's own server and
``llama-parallel`` build on; this runner drives that API for every workload, batch 1 included, so
one code path is measured:

- up to ``--max-seqs`` requests run at once, each in its own sequence (KV stream) of
  ``--max-model-len`` cells;
- each ``llama_decode`` carries one token for every decoding sequence plus prompt chunks of waiting
  ones, up to ``--n-batch`` tokens (chunked prefill, continuous batching);
- the next token is the argmax of the logits (sampling costs are not what is compared); EOS is
  never checked, so every request runs to the length it asked for;
- a finished sequence's cells are freed and the next request takes its place.

    .bench/venv-llamacpp/bin/python benches/peers/llamacpp_bench.py \
        --model .bench/qwen2-0.5b-f32.gguf --requests-dir .bench/requests --workloads startup,fixed
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Request, parser, run  # noqa: E402


@dataclass
class _Running:
    index: int  # position in the caller's request list
    request: Request
    num_prefilled: int = 0
    num_generated: int = 0
    last_token: int = 0

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.request.prompt_token_ids)


class LlamaCppEngine:
    def __init__(self, args):
        import llama_cpp as L

        from llama_cpp._logger import set_verbose

        self.L = L
        set_verbose(args.verbose)  # llama-cpp-python's own log callback, alive until exit
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(args.model.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {args.model}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.weight_bytes = int(L.llama_model_size(self.model))  # every tensor, as the file stores it
        params = L.llama_context_default_params()
        params.n_seq_max = args.max_seqs
        params.n_ctx = args.max_seqs * args.max_model_len
        params.n_batch = args.n_batch
        params.n_ubatch = min(args.n_batch, args.n_ubatch)
        params.n_threads = params.n_threads_batch = args.threads
        params.kv_unified = args.kv_unified
        self.ctx = L.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = L.llama_get_memory(self.ctx)
        self.max_seqs, self.n_batch = args.max_seqs, args.n_batch
        self.batch = L.llama_batch_init(args.n_batch, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(args.n_batch,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(args.n_batch,))
        self.n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(args.n_batch,))
        self.logits = np.ctypeslib.as_array(self.batch.logits, shape=(args.n_batch,))
        self.n_seq_id[:] = 1

    def _fill(self, running: dict[int, _Running]) -> list[tuple[int, _Running]]:
        """Puts one step's tokens in the batch; returns (seq, state) for each row with logits."""
        n, rows = 0, []
        for seq, r in running.items():  # decoding sequences first: one token each
            if not r.prefilling:
                self._put(n, r.last_token, len(r.request.prompt_token_ids) + r.num_generated - 1, seq, True)
                rows.append((seq, r))
                n += 1
        for seq, r in running.items():  # then prompt chunks, as many as fit
            if r.prefilling and n < self.n_batch:
                prompt = r.request.prompt_token_ids
                take = min(len(prompt) - r.num_prefilled, self.n_batch - n)
                for k in range(take):
                    p = r.num_prefilled + k
                    self._put(n + k, prompt[p], p, seq, p == len(prompt) - 1)
                n += take
                r.num_prefilled += take
                if not r.prefilling:
                    rows.append((seq, r))
        self.batch.n_tokens = n
        return rows

    def _put(self, i: int, token: int, pos: int, seq: int, want_logits: bool) -> None:
        self.tokens[i], self.pos[i], self.logits[i] = token, pos, want_logits
        self.batch.seq_id[i][0] = seq

    def generate(self, requests: list[Request]) -> list[int]:
        L = self.L
        waiting = deque(enumerate(requests))
        free = list(range(self.max_seqs))
        running: dict[int, _Running] = {}
        produced = [0] * len(requests)
        while waiting or running:
            while waiting and free:
                index, req = waiting.popleft()
                running[free.pop()] = _Running(index, req)
            rows = self._fill(running)
            if L.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            logits = np.ctypeslib.as_array(L.llama_get_logits(self.ctx), shape=(len(rows), self.n_vocab))
            next_tokens = logits.argmax(axis=1)
            for (seq, r), token in zip(rows, next_tokens):
                r.last_token = int(token)
                r.num_generated += 1
                if r.num_generated == r.request.output_len:
                    produced[r.index] = r.num_generated
                    L.llama_memory_seq_rm(self.memory, seq, -1, -1)
                    del running[seq]
                    free.append(seq)
        return produced


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--max-seqs", type=int, default=64, help="sequences decoded together (llama.cpp n_seq_max)")
    p.add_argument("--n-batch", type=int, default=2048, help="tokens per llama_decode call")
    p.add_argument("--n-ubatch", type=int, default=512, help="tokens per compute graph")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV buffer for all sequences (attention then spans every cell)")
    p.add_argument("--verbose", action="store_true", help="keep llama.cpp's log")
    args = p.parse_args()
    import llama_cpp

    run("llamacpp", lambda: LlamaCppEngine(args), args,
        {"version": llama_cpp.__version__, "max_seqs": args.max_seqs, "n_batch": args.n_batch,
         "kv_unified": args.kv_unified})


if __name__ == "__main__":
    main()
