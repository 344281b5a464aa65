"""Run a function on N gloo ranks in fresh processes (as torchrun would) and collect its results."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    try:
        result = fn(*args)
        torch.save({"ok": result}, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
        raise
    finally:
        from moerl.megatron.parallel import destroy_distributed

        destroy_distributed()


def run_ranks(fn, world_size: int, *args, tmp_path: Path) -> list:
    """``fn(*args)`` on every rank; returns each rank's return value. Fails with the first traceback."""
    out = Path(tmp_path) / f"ranks-{_free_port()}"
    out.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, str(out), fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        if p.is_alive():
            p.kill()
    results = []
    for r in range(world_size):
        path = out / f"rank{r}.pt"
        if not path.exists():
            raise RuntimeError(f"rank {r} died without a result (exit code {procs[r].exitcode})")
        data = torch.load(path, weights_only=False)
        if "error" in data:
            raise RuntimeError(f"rank {r} failed:\n{data['error']}")
        results.append(data["ok"])
    return results
