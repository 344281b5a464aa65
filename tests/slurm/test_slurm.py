"""The main job from one ``sbatch`` of recipes/slurm/moerl.sbatch on a local three-node Slurm cluster: the layout
checked against the allocation, the engines started on the engine node, their URLs and each trainer node's sync
address found by the script, the trainer's torchrun across the two trainer nodes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests import REPO
from tests.accounting import accounting, assert_async_run_accounted
from tests.slurm_cluster import Cluster

pytestmark = pytest.mark.e2e
SBATCH = REPO / "recipes" / "slurm" / "moerl.sbatch"


def submit(slurm: Cluster, out: Path, nodes: int, *overrides: str) -> int:
    return slurm.sbatch(
        [f"--nodes={nodes}", f"--output={out}", str(SBATCH), *overrides],
        cwd=REPO,
        env=dict(slurm.env, PYTHON=sys.executable),
    )


def logs(directory: Path) -> str:
    return "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in sorted(directory.rglob("*.log")))


def metric_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def wait_for(ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout_s} s")
        time.sleep(0.5)


def test_the_demo_runs_across_three_nodes_from_one_sbatch_and_comes_back_from_a_preemption(
    slurm, demo_model, demo_cache, tmp_path
):
    """The CPU demo (EP2: two trainer nodes of one gloo rank, one engine node) in async mode with broadcast weight sync
    and sync.verify after every update, warned of preemption after its first step: it checkpoints, the job requeues
    itself, and the requeued job resumes from that checkpoint (the only one: no periodic saves) and completes every
    step, the engines serving the trainer's weights, no prompt lost or trained twice, each node logged under the run
    directory."""
    run_dir, steps, groups = tmp_path / "run", 4, 4
    job = submit(
        slurm, tmp_path / "job.out", 3, f"run.dir={run_dir}", f"run.cache_dir={demo_cache}",
        f"model.path={demo_model}", "engines.dtype=float32", "run.mode=async", f"run.steps={steps}",
        "run.progress=false", "run.save_every=0", "sync.verify=true", f"rollout.groups_per_step={groups}",
    )  # fmt: skip
    # warned after its first step: three steps of margin for the signal's way to the job (warned after its second, a run
    # here stopped a few seconds before it would have ended)
    wait_for(lambda: len(metric_rows(run_dir)) >= 1 or slurm.state(job) not in ("PENDING", "RUNNING"), 420, "step")
    slurm.client(["scancel", "--batch", "--signal=USR1", str(job)])  # Slurm's warning, as --signal=B:USR1@N sends it
    # A requeued job is held (BeginTime) for a while: started at once here.
    wait_for(lambda: "Restarts=1" in slurm.client(["scontrol", "show", "job", str(job)]).stdout, 300, "requeue")
    wait_for(lambda: slurm.state(job) == "PENDING", 120, "requeued job pending")
    slurm.client(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    state = slurm.wait(job, timeout_s=420)
    assert state == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:] + logs(run_dir / "logs" / "slurm")
    saved = sorted(int(p.name.removeprefix("step_")) for p in (run_dir / "checkpoints").iterdir())
    assert saved[0] < steps == saved[-1], saved  # the preemption's checkpoint, then the last step's
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["sync/verify_max_abs_delta"] < 1e-4 for r in rows), rows
    # what each of its two stops (the preemption's, the end's) had ordered ahead
    assert_async_run_accounted(accounting(run_dir), trained=steps * groups, depth=2 * groups)
    per_node = sorted(p.name for p in (run_dir / "logs" / "slurm").iterdir())
    assert per_node == ["engines-node3.log", "trainer-node1.log", "trainer-node2.log"]
    assert (
        f"engines.urls=[http://{slurm.nodes.address(3)}:30000]"
        in (run_dir / "logs/slurm/engines-node3.log").read_text()
    )


def test_an_allocation_that_misfits_the_layout_fails_before_anything_starts(slurm, tmp_path):
    """Two nodes for a layout of three: one error naming what the config needs, and no run directory made."""
    run_dir = tmp_path / "run"
    job = submit(slurm, tmp_path / "job.out", 2, f"run.dir={run_dir}")
    assert slurm.wait(job, timeout_s=120) == "FAILED"
    errors = [line for line in (tmp_path / "job.out").read_text().splitlines() if "error" in line]
    assert errors == [
        "error: the config needs 3 node(s): 2 trainer node(s) for 2 rank(s) + 1 engine node(s) for 1 replica(s) of 1 "
        "GPU(s) (no GPUs: one rank or replica a node); the allocation has 2 (node[1-2]): sbatch -N 3"
    ], errors
    assert not run_dir.exists()
