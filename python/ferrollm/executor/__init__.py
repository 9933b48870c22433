"""Executors run the model on every tensor-parallel rank: `MultiprocExecutor` spawns one
`WorkerProc` per rank beyond the first, and rank 0 runs in the caller's process;
`ExternalLauncherExecutor` joins ranks that torchrun started, on one node or several."""

from ferrollm.executor.external_launcher import ExternalLauncherExecutor
from ferrollm.executor.multiproc_executor import MultiprocExecutor

__all__ = ["ExternalLauncherExecutor", "MultiprocExecutor"]
