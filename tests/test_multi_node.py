"""The main job on three network hosts, as the docs tell a user to run it (docs/main-job.md, "Several nodes"): the
engines started with ``moerl engines`` on node 3, the trainer through ``torchrun --nnodes 2`` with a c10d rendezvous
on nodes 1 and 2 (one gloo rank each), each trainer node setting ``MOERL_SYNC_ADDRESS`` to its own address. The hosts
are network namespaces this test makes (:mod:`tests.netns`); nothing binds 0.0.0.0 or reaches outside them."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moerl.orchestrator.metrics import read_metrics
from tests import REPO
from tests.accounting import accounting, assert_async_run_accounted
from tests.jobs import RECIPE, rows_so_far
from tests.netns import Nodes, unavailable

pytestmark = pytest.mark.e2e
WHY = unavailable()


@pytest.fixture
def nodes():
    if WHY is not None:
        pytest.skip(f"no network namespaces here: {WHY}")
    with Nodes() as made:
        yield made


def start_engines(nodes: Nodes, model: Path, logs: Path) -> str:
    """``moerl engines`` on node 3; the ``engines.urls=[...]`` line it prints."""
    proc = nodes.popen(
        3,
        [
            sys.executable, "-m", "moerl.cli", "engines", "--model", str(model), "--server", "embedded",
            "--host", nodes.address(3), "--dtype", "float32", "--log-dir", str(logs),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("engines.urls="):
            return line.strip()
    raise AssertionError(f"moerl engines ended ({proc.wait()}) without printing its URLs")


def trainers(
    nodes: Nodes, run_dir: Path, cache: Path, model: Path, urls: str, *overrides: str, sync_on: tuple[int, int] = (1, 2)
) -> list:
    """``torchrun --nnodes 2`` on nodes 1 and 2, each with MOERL_SYNC_ADDRESS its own address, as the docs say
    (``sync_on``: the nodes whose addresses nodes 1 and 2 set)."""
    import os

    procs = []
    for node, sync in zip((1, 2), sync_on, strict=True):
        env = dict(os.environ, MOERL_SYNC_ADDRESS=nodes.address(sync), PYTHON=sys.executable)
        procs.append(
            nodes.popen(
                node,
                [
                    sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.hostnames[0]}:29500", "--no-python",
                    "bash", str(RECIPE), f"run.dir={run_dir}", f"run.cache_dir={cache}", f"model.path={model}", urls,
                    "run.progress=false", "sync.verify=true", "rollout.groups_per_step=4", *overrides,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=env,
            )
        )  # fmt: skip
    return procs


def finished(procs: list, timeout_s: float = 420) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    out = []
    for proc in procs:
        _, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        out.append((proc.returncode, stderr))
    return out


def wait_for_steps(run_dir: Path, procs: list, steps: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while len(rows_so_far(run_dir)) < steps:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), f"no step within {timeout_s} s"
        time.sleep(0.5)


def engine_changes(log: Path, url: str) -> list[tuple[datetime.datetime, str]]:
    """When the rollout manager's log says the replica at ``url`` changed state, and to which."""
    pattern = re.compile(rf"^(\S+ \S+) moerl\.engines \w+ engine {re.escape(url)}: \w+ -> (\w+) ")
    changes = []
    for line in log.read_text().splitlines():
        if found := pattern.match(line):
            changes.append((datetime.datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f"), found[2]))
    return changes


def test_the_job_trains_across_three_hosts_and_survives_the_engine_nodes_network_gone(
    nodes, demo_model, demo_cache, tmp_path
):
    """Async mode, broadcast weight sync from each trainer node to the engine node, sync.verify after every update: the
    steps complete and the engines serve the trainer's weights. Node 3's interface down for 15 s mid-run, then up: its
    requests pass their deadline, the replica leaves rotation while its probes fail, a probe brings it back once the
    interface is, and no prompt is lost. (A resume across nodes: tests/slurm, after a preemption.)"""
    urls = start_engines(nodes, demo_model, tmp_path / "engine-logs")
    assert re.fullmatch(rf"engines.urls=\[http://{re.escape(nodes.address(3))}:30000\]", urls), urls
    url = urls.removeprefix("engines.urls=[").removesuffix("]")
    run_dir = tmp_path / "run"
    procs = trainers(
        nodes, run_dir, demo_cache, demo_model, urls, "run.mode=async", "run.steps=4", "engines.request_timeout_s=8",
        "engines.health_interval_s=0.5",
    )  # fmt: skip
    wait_for_steps(run_dir, procs, 1)
    cut = datetime.datetime.now()
    nodes.cut(3)
    time.sleep(15)
    nodes.restore(3)
    restored = datetime.datetime.now()
    for rc, stderr in finished(procs):
        assert rc == 0, stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert all(r["sync/verify_max_abs_delta"] < 1e-4 for r in rows), rows
    changes = engine_changes(run_dir / "logs" / "rollout_manager.log", url)
    assert any(cut <= at <= restored and state != "healthy" for at, state in changes), changes
    assert any(at >= restored and state == "healthy" for at, state in changes), changes
    assert_async_run_accounted(accounting(run_dir), trained=4 * 4, depth=4)


def test_a_sync_address_of_another_host_is_refused_at_start_naming_it(nodes, demo_model, demo_cache, tmp_path):
    """Node 2 given node 1's address (the same environment copied to both nodes): its weight groups' rendezvous could
    never listen there. Refused before the ranks meet, naming MOERL_SYNC_ADDRESS; the job ends on both nodes."""
    urls = start_engines(nodes, demo_model, tmp_path / "engine-logs")
    procs = trainers(nodes, tmp_path / "run", demo_cache, demo_model, urls, "run.steps=1", sync_on=(1, 1))
    (first_rc, _), (second_rc, stderr) = finished(procs, timeout_s=300)
    assert first_rc != 0 and second_rc != 0
    assert f"MOERL_SYNC_ADDRESS={nodes.address(1)} is not an address of this host (node2" in stderr, stderr[-4000:]
    assert nodes.running(1) == [] and nodes.running(2) == []


def test_a_trainer_nodes_network_cut_ends_the_job_with_one_error_and_nothing_left_running(
    nodes, demo_model, demo_cache, tmp_path
):
    """Node 2's interface goes down mid-run: nothing closes a connection, so the ranks' collectives would wait for
    hours. Each rank's heartbeat (run.peer_silence_s) ends it: node 1 says rank 1 has not been heard from, node 2 that
    it lost the others; no process of the job is left on either node."""
    urls = start_engines(nodes, demo_model, tmp_path / "engine-logs")
    run_dir = tmp_path / "run"
    procs = trainers(
        nodes, run_dir, demo_cache, demo_model, urls, "run.mode=async", "run.steps=200", "run.peer_silence_s=10"
    )
    wait_for_steps(run_dir, procs, 2)
    nodes.cut(2)
    start = time.monotonic()
    (first_rc, first), (second_rc, second) = finished(procs, timeout_s=180)
    assert first_rc != 0 and second_rc != 0
    assert "error: rank 1 has not been heard from for" in first, first[-3000:]
    assert "has not answered rank 1 for" in second, second[-3000:]
    assert time.monotonic() - start < 120
    assert nodes.running(1) == [] and nodes.running(2) == []
