"""The helpers of recipes/slurm/moerl.sbatch: the job's layout on the allocation, a node's address, the engines' URLs.

    python recipes/slurm/job.py plan OVERRIDES...   # shell assignments of the layout; one error line where it misfits
    python recipes/slurm/job.py address HOST         # this node's address on its route to HOST
    python recipes/slurm/job.py urls PID LOG...      # the engine nodes' URLs, once every log has printed them

Only the standard library and PyYAML: the config is read through ``moerl train --show-config`` (the keys users type),
so nothing here imports moerl.
"""

from __future__ import annotations

import math
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import yaml


class LayoutError(Exception):
    pass


def gpus_per_node() -> int:
    """GPUs each node of the allocation has: MOERL_GPUS_PER_NODE, else Slurm's count for this node (--gpus-per-node,
    --gres), else this node's own; 0 on CPU nodes."""
    given = os.environ.get("MOERL_GPUS_PER_NODE") or os.environ.get("SLURM_GPUS_ON_NODE")
    if given:
        return int(given)
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return len(listed.stdout.splitlines()) if listed.returncode == 0 else 0


def trainer_world(cfg: dict) -> int:
    """The trainer's ranks, as the job counts them (moerl.orchestrator.preflight.trainer_world_size)."""
    if cfg["simulation"]["profile"] is not None:
        return 1
    t = cfg["trainer"]
    return cfg["run"]["trainer_ranks"] or t["tp"] * t["pp"] * t["ep"]


def layout(cfg: dict, gpus: int, nodes: int) -> dict[str, int]:
    """Trainer nodes and ranks per node, engine nodes and replicas per node. A node is a trainer's or an engine's,
    never both. Without GPUs a node holds one trainer rank or one engine replica (the CPU demo). Engines are started
    on nodes of their own unless the config gives their URLs or colocates them (then the job starts them itself)."""
    world = trainer_world(cfg)
    slots = gpus or 1
    if world <= slots:
        trainer_nodes, ranks_per_node = 1, world
    elif world % slots == 0:
        trainer_nodes, ranks_per_node = world // slots, slots
    else:
        raise LayoutError(f"the trainer's {world} ranks do not fill whole nodes of {slots} GPUs")
    e = cfg["engines"]
    own_engines = cfg["run"]["placement"] == "separate" and not e["urls"]
    engine_nodes = replicas_per_node = 0
    if own_engines:
        if e["gpus_per_replica"] > slots:
            raise LayoutError(f"engines.gpus_per_replica={e['gpus_per_replica']} exceeds a node's {slots} GPUs")
        engine_nodes = math.ceil(e["replicas"] / (slots // e["gpus_per_replica"]))
        if e["replicas"] % engine_nodes:
            raise LayoutError(f"engines.replicas={e['replicas']} do not spread evenly over {engine_nodes} nodes")
        replicas_per_node = e["replicas"] // engine_nodes
    needed = trainer_nodes + engine_nodes
    if needed != nodes:
        per_node = f"{gpus} GPUs a node" if gpus else "no GPUs: one rank or replica a node"
        engines = (
            f" + {engine_nodes} engine node(s) for {e['replicas']} replica(s) of {e['gpus_per_replica']} GPU(s)"
            if own_engines
            else ""
        )
        raise LayoutError(
            f"the config needs {needed} node(s): {trainer_nodes} trainer node(s) for {world} rank(s){engines} "
            f"({per_node}); the allocation has {nodes} ({os.environ.get('SLURM_JOB_NODELIST', '?')}): "
            f"sbatch -N {needed}"
        )
    return {
        "trainer_nodes": trainer_nodes,
        "ranks_per_node": ranks_per_node,
        "engine_nodes": engine_nodes,
        "replicas_per_node": replicas_per_node,
    }


def engine_args(cfg: dict, gpus: int, replicas: int) -> list[str]:
    """``moerl engines`` options serving what the job would start itself (its engines section, its LoRA)."""
    e = cfg["engines"]
    server = e["server"] if e["server"] != "auto" else ("sglang" if gpus else "embedded")
    args = [
        "--model", str(cfg["model"]["path"]), "--server", server, "--replicas", str(replicas),
        "--gpus-per-replica", str(e["gpus_per_replica"]), "--dtype", e["dtype"],
        "--mem-fraction-static", str(e["mem_fraction_static"]),
    ]  # fmt: skip
    if cfg["lora"]["enabled"]:
        args += ["--lora-max-rank", str(cfg["lora"]["rank"]), "--lora-targets", *cfg["lora"]["targets"]]
    return args


def plan(overrides: list[str]) -> int:
    python = os.environ.get("PYTHON", sys.executable)
    shown = subprocess.run(
        [python, "-m", "moerl.cli", "train", "--show-config", *overrides], capture_output=True, text=True
    )
    if shown.returncode != 0:
        sys.stderr.write(shown.stderr)
        return 2
    cfg = yaml.safe_load(shown.stdout)
    gpus = gpus_per_node()
    try:
        found = layout(cfg, gpus, int(os.environ["SLURM_JOB_NUM_NODES"]))
        if found["engine_nodes"] and cfg["model"]["path"] is None:
            raise LayoutError("engines on nodes of their own need model.path (the HF directory every node reads)")
    except LayoutError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    given = cfg["engines"]["urls"]
    values: dict[str, object] = {
        **found,
        "run_dir": str(Path(cfg["run"]["dir"]).absolute()),
        "sync_peer": urlsplit(given[0]).hostname if given else "",  # where engines given by URL are
    }
    for name, value in values.items():
        print(f"{name}={shlex.quote(str(value))}")
    if found["engine_nodes"]:
        args = engine_args(cfg, gpus, found["replicas_per_node"])
        print(f"engine_args=({shlex.join(args)})")
    return 0


def address(host: str) -> int:
    """The address of this node's interface on the route to ``host`` (a UDP connect sends nothing): the one ``host``
    reaches it at."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        print(s.getsockname()[0])
    return 0


def urls(pid: int, logs: list[str]) -> int:
    """Wait for each engine node's log to print its ``engines.urls=[...]`` line; print them joined. Fails, with the
    logs' ends, once the engine step (``pid``, its srun) has ended first."""
    found: dict[str, list[str]] = {}
    while len(found) < len(logs):
        for log in logs:
            path = Path(log)
            text = path.read_text(errors="replace") if path.exists() else ""
            for line in text.splitlines():
                if line.startswith("engines.urls=["):
                    found[log] = [u for u in line.strip().removeprefix("engines.urls=[").rstrip("]").split(",") if u]
        if len(found) < len(logs):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                tails = "".join(
                    f"\n== {log}\n" + "\n".join(Path(log).read_text(errors="replace").splitlines()[-20:])
                    for log in logs
                    if Path(log).exists()
                )
                print(f"error: the engine step ended before every engine node served{tails}", file=sys.stderr)
                return 2
            time.sleep(1)
    print("engines.urls=[" + ",".join(url for log in logs for url in found[log]) + "]")
    return 0


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "plan":
        return plan(rest)
    if command == "address":
        return address(rest[0])
    if command == "urls":
        return urls(int(rest[0]), rest[1:])
    print(f"error: unknown command {command}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
