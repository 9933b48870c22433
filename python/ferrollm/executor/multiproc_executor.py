"""`MultiprocExecutor`: tensor parallelism over processes on one machine.

Rank 0 runs in the caller's process, next to the engine core; ranks 1..N-1 are spawned (never
forked, so a parent that already touched CUDA is safe) and run `WorkerProc`. The core publishes
every step on a shared-memory channel the workers read; rare commands (`collective_rpc`: load the
model, size the KV cache, save weights) are announced on the channel and carried by one pipe per
worker. The ranks all-reduce through ``torch.distributed`` (gloo on the CPU, NCCL on GPUs).

Faults: a monitor thread watches the workers' process sentinels. When one dies it aborts the
channel, so a publish waiting on it returns at once; a rank 0 blocked in a collective with a dead
peer gets an error from gloo/NCCL as the peer's sockets close. Either way the caller gets a
`WorkerError` with the worker's traceback (or exit code), the workers are shut down, and the
engine is dead. `shutdown()` (also run when the executor is collected and at interpreter exit)
leaves no process behind.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import tempfile
import threading
import weakref
from multiprocessing.connection import wait
from typing import Any

import torch

from ferrollm._core import StepBroadcaster
from ferrollm.config.model_config import ModelConfig
from ferrollm.exceptions import EngineDeadError, FerroLLMError, StepChannelError, WorkerError
from ferrollm.executor.launch import Rendezvous, cpu_threads_per_rank, rank_device
from ferrollm.executor.worker_proc import WorkerConfig, worker_main
from ferrollm.worker.worker import CacheOptions, Worker

# Seconds a collective may wait for a peer (FERROLLM_DIST_TIMEOUT); a dead peer is noticed far
# sooner, when its sockets close.
DIST_TIMEOUT_S = float(os.environ.get("FERROLLM_DIST_TIMEOUT", "600"))
# How long after rank 0 failed mid-step a worker's own error report is waited for.
FAILURE_GRACE_S = 3.0


class _Workers:
    """The spawned processes, their pipes and the channel; shuts them down exactly once. Held
    apart from the executor so a `weakref.finalize` can run it without keeping the executor alive."""

    def __init__(self, broadcaster: StepBroadcaster):
        self.broadcaster = broadcaster
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Any] = []
        self.failure: BaseException | None = None
        self.stopping = False
        self.in_group = False
        self._stop_r, self._stop_w = os.pipe()

    def watch(self) -> None:
        """Monitor thread: the first worker to exit while the engine runs aborts the channel."""
        sentinels = [p.sentinel for p in self.procs]
        ready = wait([*sentinels, self._stop_r])
        if self._stop_r not in ready and not self.stopping:
            self.broadcaster.abort()

    def shutdown(self, graceful: bool) -> None:
        if self.stopping:
            return
        self.stopping = True
        os.write(self._stop_w, b"x")
        alive = graceful and self.failure is None and all(p.is_alive() for p in self.procs)
        if alive:
            try:
                self.broadcaster.publish_shutdown()
                _leave_group()
                self.in_group = False
            except Exception:  # noqa: BLE001 - a worker died meanwhile: terminate below
                pass
        for p in self.procs:
            p.join(timeout=5 if alive else 0.5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
        if self.in_group:
            _leave_group(barrier=False)
        self.broadcaster.close()
        for c in self.conns:
            c.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        from ferrollm.distributed import init_tensor_model_parallel

        init_tensor_model_parallel(0, 1)


def _leave_group(barrier: bool = True) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()


class MultiprocExecutor:
    """Runs ``world_size`` ranks: rank 0 here (`driver_worker`), the others spawned.

    Args:
        model_config: the model (sent to every rank).
        options: KV cache sizing and load format.
        device: ``cpu`` or ``cuda``; rank i of a GPU engine takes the i-th visible GPU.
        world_size: ``tensor_parallel_size`` (> 1).

    Raises:
        ConfigError: if the process group is already in use, or there are too few GPUs.
        WorkerError: if a worker fails to start.
    """

    def __init__(self, model_config: ModelConfig, options: CacheOptions, device: torch.device, world_size: int):
        import torch.distributed as dist

        from ferrollm.exceptions import ConfigError

        if dist.is_initialized():
            raise ConfigError("a tensor-parallel engine is already running in this process (torch.distributed "
                              "is initialised); close() it before building another")
        self.world_size = world_size
        driver_device = rank_device(device, 0, world_size)
        backend = "nccl" if device.type == "cuda" else "gloo"
        rendezvous = Rendezvous.from_env()
        threads = cpu_threads_per_rank(world_size)
        self._workers = _Workers(StepBroadcaster(world_size - 1, timeout_s=DIST_TIMEOUT_S))
        self.broadcaster = self._workers.broadcaster
        self._finalizer = weakref.finalize(self, self._workers.shutdown, False)
        self._start_workers(WorkerConfig(
            rank=0, world_size=world_size, rendezvous=rendezvous, backend=backend, timeout_s=DIST_TIMEOUT_S,
            device=device, num_threads=threads, model_config=model_config, options=options,
            channel_path=str(self.broadcaster.path), parent_pid=os.getpid()))
        threading.Thread(target=self._workers.watch, name="ferrollm-worker-monitor", daemon=True).start()
        if device.type == "cpu":
            torch.set_num_threads(threads)
        else:
            torch.cuda.set_device(driver_device)
        self._join_group(backend, rendezvous)
        self._await_replies("ready")
        self.driver_worker = Worker(model_config, options, 0, world_size, driver_device)

    def _start_workers(self, base: WorkerConfig) -> None:
        from dataclasses import replace

        ctx = multiprocessing.get_context("spawn")
        fd, self._startup_error_file = tempfile.mkstemp(prefix="ferrollm-startup-")
        os.close(fd)
        # A worker that re-imports a script without a __main__ guard writes why here.
        os.environ["FERROLLM_STARTUP_ERROR_FILE"] = self._startup_error_file
        try:
            for rank in range(1, self.world_size):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=worker_main, args=(replace(base, rank=rank), child),
                                   name=f"FerroLLMWorker-{rank}", daemon=True)
                proc.start()
                child.close()
                self._workers.procs.append(proc)
                self._workers.conns.append(parent)
        finally:
            del os.environ["FERROLLM_STARTUP_ERROR_FILE"]

    def _join_group(self, backend: str, rendezvous: Rendezvous) -> None:
        """Joins the process group from a helper thread while watching the workers, so a worker
        that dies during start-up is reported instead of waited for."""
        import torch.distributed as dist

        from ferrollm.distributed import init_tensor_model_parallel

        done: list[BaseException | None] = []

        def join() -> None:
            try:
                dist.init_process_group(backend, init_method=rendezvous.init_method, rank=0,
                                        world_size=self.world_size,
                                        timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
                done.append(None)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                done.append(e)

        thread = threading.Thread(target=join, name="ferrollm-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.1)
            if not thread.is_alive():
                break
            if any(not p.is_alive() for p in self._workers.procs):
                self._raise_failure(None, during="start-up")
        if done and done[0] is not None:
            self.shutdown()
            raise done[0]
        self._workers.in_group = True
        init_tensor_model_parallel(0, self.world_size)

    # -- commands -------------------------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Calls ``Worker.<method>(*args)`` on every rank; returns the results in rank order.

        Raises:
            WorkerError: if a worker raised or died (with its traceback).
        """
        self.check_alive()
        try:
            self.broadcaster.publish_control()
            for conn in self._workers.conns:
                conn.send((method, args))
            local = getattr(self.driver_worker, method)(*args)
        except BaseException as e:
            self._raise_failure(e)
        return [local, *self._await_replies(method)]

    def _await_replies(self, what: str) -> list[Any]:
        results = []
        for rank, (proc, conn) in enumerate(zip(self._workers.procs, self._workers.conns), start=1):
            wait([conn, proc.sentinel])
            if not conn.poll():
                self._raise_failure(None, during=what)
            status, payload = conn.recv()
            if status == "error":
                self._raise_failure(None, during=what)
            results.append(payload)
        return results

    def check_alive(self) -> None:
        """Raises if a rank failed earlier (the engine cannot run steps any more)."""
        failure = self._workers.failure
        if failure is not None:
            raise EngineDeadError(f"the tensor-parallel engine is dead after an earlier failure: {failure}") from failure
        if self._workers.stopping:
            raise EngineDeadError("the tensor-parallel workers have been shut down")
        if any(not p.is_alive() for p in self._workers.procs):
            self._raise_failure(None)

    def _raise_failure(self, cause: BaseException | None, during: str = "a step"):
        """Shuts the workers down and raises: the worker's error if one failed, else ``cause``."""
        error = self._worker_error(FAILURE_GRACE_S if cause is not None else 5.0, during)
        self._workers.failure = error or cause or EngineDeadError("unknown failure")
        self.shutdown(graceful=False)
        # A configuration or checkpoint error on rank 0 is the same on every rank: the caller
        # gets it as raised here rather than wrapped in a worker's copy.
        own = isinstance(cause, FerroLLMError) and not isinstance(cause, StepChannelError)
        if error is not None and not own:
            raise error from cause
        if cause is None:
            raise EngineDeadError(f"a tensor-parallel worker stopped during {during} without reporting why")
        raise cause

    def _worker_error(self, grace_s: float, during: str) -> WorkerError | None:
        """The first worker's error report or exit, waiting up to ``grace_s`` for one."""
        w = self._workers
        waitables = [*w.conns, *(p.sentinel for p in w.procs)]
        if not wait(waitables, timeout=grace_s):
            return None
        for rank, (proc, conn) in enumerate(zip(w.procs, w.conns), start=1):
            if conn.poll():
                try:
                    status, payload = conn.recv()
                except EOFError:
                    status, payload = "eof", None
                if status == "error":
                    return WorkerError(f"tensor-parallel worker rank {rank} raised during {during}:\n{payload}")
        for rank, proc in enumerate(w.procs, start=1):
            proc.join(timeout=1.0)
            if not proc.is_alive():
                return WorkerError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) died during {during} "
                                   f"with exit code {proc.exitcode}"
                                   f"{self._startup_hint() if during == 'start-up' else ''}")
        return None

    def _startup_hint(self) -> str:
        try:
            with open(self._startup_error_file) as f:
                text = f.read()
        except OSError:
            return ""
        return f":\n{text}" if text else "; its stderr says why"

    def worker_pids(self) -> list[int]:
        """The spawned ranks' process ids (rank 1 first)."""
        return [p.pid for p in self._workers.procs if p.pid is not None]

    def shutdown(self, graceful: bool = True) -> None:
        """Stops every worker (after a last barrier when all are healthy). Safe to call twice."""
        self._workers.shutdown(graceful)
        self._finalizer.detach()
        try:
            os.unlink(self._startup_error_file)
        except OSError:
            pass
