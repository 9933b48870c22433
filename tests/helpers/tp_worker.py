"""One tensor-parallel rank of a test, run in a spawned process: joins a gloo group, loads tiny
checkpoints sharded for its rank, drives the engine, and rank 0 saves what it generated."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ferrollm.distributed import init_tensor_model_parallel


def run_rank(rank: int, world_size: int, init_file: str, folders: list[str],
             prompts: list[list[int]], max_tokens: int, out_dir: str) -> None:
    """``torch.multiprocessing.spawn`` target; writes ``out_dir/<i>.pt`` for ``folders[i]``."""
    from helpers.engine_driver import load_ferrollm_model, run_engine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    init_tensor_model_parallel(rank, world_size)
    try:
        for i, folder in enumerate(folders):
            # Every rank runs its own engine core; they schedule identically because they get the
            # same requests and the same (all-gathered) logits.
            run = run_engine(load_ferrollm_model(Path(folder)), prompts, max_tokens)
            if rank == 0:
                torch.save({"tokens": run.tokens, "logits": run.logits}, Path(out_dir) / f"{i}.pt")
    finally:
        # Both ranks leave together: a rank tearing gloo down while the other still has
        # collectives in flight aborts the process ("terminate called without an active exception").
        dist.barrier()
        dist.destroy_process_group()
