"""Run a function on N local ranks in fresh processes (as torchrun would) and collect the results.

Used by ``convert_ckpt.py verify`` for multi-rank layouts and by the multi-rank tests. Each rank
gets torchrun's environment variables; results and tracebacks come back through files.

Where no GPU exists, ranks are forked from multiprocessing's fork server, which imports megatron-core (and the
modules :func:`start_fork_server` names) once: spawned, every rank pays those imports again (about 4 s a launch of
two ranks on two cores). With a GPU they are spawned, each seeing the devices its launch allows.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
from multiprocessing import connection, forkserver, reduction
from multiprocessing.context import ForkServerContext, SpawnContext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moerl.errors import MoerlError
from moerl.megatron.parallel import destroy_distributed

# What every rank imports: megatron-core and moerl's use of it (the trainer, checkpoints, weight export).
RANK_MODULES = ["moerl.trainer.trainer", "moerl.checkpoint.verify", "moerl.weight_sync.export"]


class _Stdio:
    """The launcher's stdout and stderr as a rank's: a spawned rank inherits them, one forked from the fork server has
    the server's (those it started with) unless they are sent along, as descriptors pickled while the rank starts."""

    def __init__(self, fds: tuple = ()):
        self._fds = fds

    def __reduce__(self):
        return _Stdio, ((reduction.DupFd(1), reduction.DupFd(2)),)

    def adopt(self) -> None:
        for target, fd in zip((1, 2), self._fds, strict=True):
            os.dup2(fd.detach(), target)


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args, launcher: tuple) -> None:
    # The launcher's output, environment and directory as they are now, as a spawned process would start with (a fork
    # server's child has the server's, from when it started).
    stdio, env, cwd = launcher
    stdio.adopt()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # As under torchrun, the launching process hosts the rendezvous store and every rank is its client.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        torch.save({"ok": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException as e:
        # A user's mistake (a MoerlError) travels as itself, so callers report it as one line.
        torch.save(
            {"error": traceback.format_exc(), "mistake": e if isinstance(e, MoerlError) else None},
            Path(out_dir) / f"rank{rank}.pt",
        )
        raise
    finally:
        destroy_distributed()


@contextlib.contextmanager
def _cuda_hidden():
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def start_fork_server(preload: list[str]) -> None:
    """Start the fork server CPU ranks come from (one per process, shared with anything else that forks from it),
    importing :data:`RANK_MODULES` and ``preload`` once, with CUDA hidden; a no-op where it runs already. The first CPU
    launch starts it; a process that also forks other helpers from it (generation workers) starts it first, here."""
    mp.set_forkserver_preload([*RANK_MODULES, *preload])
    with _cuda_hidden():
        forkserver.ensure_running()


def run_ranks(fn, world_size: int, *args, use_cuda: bool | None = None, timeout_s: float = 900) -> list:
    """``fn(*args)`` on every rank; returns each rank's return value. Fails with the first traceback.

    ``fn`` must be importable (module level) since ranks are spawned, not forked. Ranks use one GPU
    each (NCCL) when ``use_cuda``; by default, when there are at least ``world_size`` GPUs, and
    otherwise they run on the CPU with gloo.
    """
    if use_cuda is None:
        use_cuda = torch.cuda.device_count() >= world_size
    elif use_cuda and torch.cuda.device_count() < world_size:
        raise RuntimeError(f"{world_size} CUDA ranks need {world_size} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory(prefix="moerl-ranks-") as out:
        return _run(fn, world_size, args, Path(out), timeout_s, use_cuda)


def _run(fn, world_size: int, args: tuple, out: Path, timeout_s: float, use_cuda: bool) -> list:
    ctx: SpawnContext | ForkServerContext
    if use_cuda or torch.cuda.is_available():
        ctx = mp.get_context("spawn")
    else:
        start_fork_server([fn.__module__])
        ctx = mp.get_context("forkserver")
    # Bound here, on a port the OS picks, and held until the ranks end: a port picked now and bound by
    # rank 0 seconds later (after its imports) could be taken in between by another process.
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    # CPU ranks must never see a GPU: a spawned child imports megatron-core (which asks torch about CUDA, and
    # torch remembers the answer) while unpickling ``fn``, before any code of ours runs in it, so the
    # variable has to be in the environment it starts with.
    with _cuda_hidden() if not use_cuda else contextlib.nullcontext():
        launcher = (_Stdio(), dict(os.environ), os.getcwd())
        procs = [
            ctx.Process(target=_entry, args=(r, world_size, store.port, str(out), fn, args, launcher))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    deadline = time.monotonic() + timeout_s
    # One failed rank leaves the others blocked in a collective: stop them all at once.
    while running := [p for p in procs if p.is_alive()]:
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            break
        # until a rank ends (or the deadline)
        connection.wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.join()
    results = []
    for r in range(world_size):
        path = out / f"rank{r}.pt"
        if not path.exists():
            continue
        data = torch.load(path, weights_only=False)
        if data.get("mistake") is not None:
            raise data["mistake"]
        if "error" in data:
            raise RuntimeError(f"rank {r} failed:\n{data['error']}")
        results.append(data["ok"])
    if len(results) != world_size:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"ranks ended without a result (exit codes {codes}; a timeout or a crash)")
    return results
