"""The main job in a simulation (``simulation.profile``): its own orchestrator against simulated engines and a simulated
trainer, in each mode, with every prompt accounted for and staleness within its bound."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moerl.env import child_env
from moerl.orchestrator.metrics import read_metrics
from moerl.orchestrator.run_state import STOP_REQUEST
from moerl.simulation import Profile
from moerl.weight_sync.simulated import write_hollow_safetensors
from tests import DATA, REPO
from tests.accounting import accounting
from tests.jobs import RECIPE

PROFILE = DATA / "simulation" / "tiny.yaml"
GROUPS, N, TIME_SCALE = 4, 4, 4.0


def simulate(model: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    # Three replicas, two in one process: the pool's shared processes and a process of its own both serve.
    args = [
        "bash",
        str(RECIPE),
        f"run.dir={run_dir}",
        "run.progress=false",
        f"model.path={model}",
        f"simulation.profile={PROFILE}",
        f"simulation.time_scale={TIME_SCALE}",
        "simulation.trainer_gpus=1",
        "simulation.replicas_per_process=2",
        "engines.replicas=3",
        f"rollout.groups_per_step={GROUPS}",
        f"rollout.samples_per_prompt={N}",
        "rollout.max_new_tokens=64",
        *overrides,
    ]
    return subprocess.run(
        args, env=child_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=300, cwd=REPO
    )


@pytest.mark.e2e
@pytest.mark.parametrize("mode, staleness", [("sync", 0), ("periodic", 0), ("async", 1)])
def test_a_simulated_job_runs_each_mode_with_every_prompt_accounted(model, tmp_path, mode, staleness):
    """Async mode's groups are the profile's agentic episodes: several turns, a tool's wait and output between them.
    The sync run is asked to stop before it starts (a scheduler's warning of preemption): it checkpoints at its first
    safe point, in the first step or after it, and ends; resumed from the simulated trainer's checkpoint, it completes
    with no prompt lost or trained twice."""
    steps = 3
    agentic = ["rollout.agent=simulated", "rollout.max_episode_tokens=400"] if mode == "async" else []
    run = [f"run.mode={mode}", f"run.steps={steps}", "rollout.max_staleness=1", "run.save_every=2", *agentic]
    if mode == "sync":
        (tmp_path / STOP_REQUEST).touch()
        out = simulate(model, tmp_path, *run)
        assert out.returncode == 0 and "stopped at step" in out.stderr, out.stderr[-4000:]
        assert not (tmp_path / STOP_REQUEST).exists()
        assert len(read_metrics(tmp_path)) < steps
        run.append("run.resume=true")
    out = simulate(model, tmp_path, *run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    trainer = Profile.load(PROFILE).trainer
    for r in rows:
        assert r["mode"] == mode and r["rollout/samples"] == GROUPS * N
        assert r["staleness/max"] <= staleness
        # The step held for the profile's time of at least its response tokens (the fed tokens count the prompts too).
        assert (
            r["time/train_seconds"] >= (trainer.seconds(r["train/tokens"], 1) + trainer.optimizer_step_s) / TIME_SCALE
        )
        # Every sync moved the model's whole size, of a checkpoint made of holes.
        assert r["sync/bytes"] == r["sync/full_weight_bytes"] > 0
        assert r["cpu/buffer_seconds"] > 0 and 0 <= r["cpu/manager_fraction"] < 1
        assert 0 < r["cpu/machine_busy_fraction"] <= 1  # the buffer's CPU, at least, was the machine's
    assert sum(r["cpu/manager_seconds"] for r in rows) > 0  # counted in clock ticks (10 ms): a tiny step may show none
    acct = accounting(tmp_path)
    assert acct["balanced"] and acct["live"] == 0 and acct["trained"] == steps * GROUPS
    if mode == "periodic":
        assert acct["dropped"] == {}
    elif mode == "sync":  # a step's groups ordered when the stop came may be left unused; none other
        assert set(acct["dropped"]) <= {"unused_at_stop"} and sum(acct["dropped"].values()) <= GROUPS
    else:
        # updates met requests in flight, continued in place
        assert sum(r["rollout/mixed_version_fraction"] for r in rows) > 0
        for r in rows:  # one sample per episode, tool output fed as context, each position's routing received once
            assert r["episode/turns_mean"] > 1 and r["episode/failures"] == 0 and r["episode/forks"] == 0
            assert r["episode/env_token_fraction"] > 0
            assert 0 < r["routing/rows_received"] < r["routing/rows_full_sequence"]
    engines = sorted(p.name for p in (tmp_path / "logs").glob("simulated-*.log"))
    assert engines == ["simulated-0.log", "simulated-2.log"]  # replicas 0 and 1 in one process, 2 in another


@pytest.mark.e2e
def test_the_generation_workers_carry_a_deep_models_answers_and_killing_them_loses_no_prompt(model, tmp_path):
    """48 layers x top-8 (Qwen3-30B-A3B's routing width) make every answer large enough for the manager's generation
    workers; each is killed mid-run, twice: the prompts they carried are re-issued, none is dropped or blamed on an
    engine."""
    import threading
    import time

    import psutil

    deep = tmp_path / "deep"
    deep.mkdir()
    for f in model.glob("tokenizer*"):
        (deep / f.name).write_bytes(f.read_bytes())
    config = json.loads((model / "config.json").read_text())
    config.update(num_hidden_layers=48, num_experts_per_tok=8, num_local_experts=16, mlp_only_layers=[])
    (deep / "config.json").write_text(json.dumps(config))
    killed: list[int] = []
    rounds: list[int] = []  # workers killed in each round

    def command(p: psutil.Process) -> str:
        try:
            return " ".join(p.cmdline())
        except psutil.Error:  # it ended while it was looked at
            return ""

    def children(p: psutil.Process) -> list[psutil.Process]:
        try:
            return p.children()
        except psutil.Error:
            return []

    def workers() -> list[psutil.Process]:
        return [
            w
            for manager in psutil.process_iter()
            if "moerl.cli.rollout_manager" in (line := command(manager)) and str(tmp_path) in line
            for child in children(manager)
            if "forkserver" in command(child)
            for w in children(child)
            if w.pid not in killed
        ]

    def kill_twice() -> None:
        for _ in range(2):
            # both started (the second round: both again), however long the job takes to get there
            while len(found := workers()) < 2 and not job_ended.is_set():
                time.sleep(0.2)
            time.sleep(1.0)  # while they carry requests
            for w in found:
                try:
                    w.kill()
                except psutil.Error:
                    continue
                killed.append(w.pid)
            rounds.append(len(found))

    job_ended = threading.Event()
    killer = threading.Thread(target=kill_twice, daemon=True)
    killer.start()
    out = simulate(
        deep,
        tmp_path / "run",
        "run.mode=async",
        "run.steps=4",
        "rollout.max_new_tokens=128",
        "rollout.generation_workers=2",
    )
    job_ended.set()
    killer.join(timeout=10)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert rounds == [2, 2] and len(killed) == 4, (rounds, killed)
    rows = read_metrics(tmp_path / "run")
    assert sum(r["cpu/manager_helpers_seconds"] for r in rows) > 0
    assert (
        sum(r["rollout/retries_engine_failure"] for r in rows) == 0 and rows[-1]["prompts/dropped_engine_failure"] == 0
    )
    acct = accounting(tmp_path / "run")
    assert acct["balanced"] and acct["trained"] == 4 * GROUPS
    log = (tmp_path / "run" / "logs" / "rollout_manager.log").read_text()
    lost = log.count("re-issued: the generation worker carrying it died")
    assert log.count("a generation worker died") >= 2 and lost >= 1
    # those of prompts still live at the end are not in a step
    assert 1 <= sum(r["rollout/retries_worker_lost"] for r in rows) <= lost


def test_a_hollow_checkpoint_has_the_real_header_and_no_bytes_on_disk(tmp_path):
    from safetensors import safe_open

    named = [
        ("a.weight", torch.empty(4096, 65536, dtype=torch.bfloat16, device="meta")),
        ("b.bias", torch.empty(3, dtype=torch.float32, device="meta")),
    ]
    path = tmp_path / "model-00000.safetensors"
    write_hollow_safetensors(named, path)
    stat = path.stat()
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
    assert stat.st_size == 8 + header_len + 4096 * 65536 * 2 + 12
    assert stat.st_blocks * 512 < 1 << 20  # 512 MiB apparent, nothing allocated
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["a.weight", "b.bias"]
        assert f.get_slice("a.weight").get_shape() == [4096, 65536] and f.get_slice("b.bias").get_dtype() == "F32"
        assert f.get_tensor("b.bias").tolist() == [0.0, 0.0, 0.0]  # a hole reads as zeros


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, message",
    [
        ("sync.verify=true", "simulated engines hold no weights"),
        ("lora.enabled=true", "full weights only"),
        ("engines.server=embedded", "leave engines.server=auto"),
        ("simulation.time_scale=0", "simulation.time_scale must be > 0"),
        ("trainer.replay.trace_samples=2", "runs no routers to trace"),
        ("rollout.agent=tool_agent", "a simulation runs rollout.agent=simulated"),
    ],
)
def test_what_a_simulation_cannot_do_is_one_error(model, tmp_path, override, message):
    out = simulate(model, tmp_path, override)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


@pytest.mark.e2e
def test_a_profile_without_a_trainer_is_refused_by_the_job(model, tmp_path):
    engine_only = tmp_path / "engine.yaml"
    engine_only.write_text("\n".join(line for line in PROFILE.read_text().split("trainer:")[0].splitlines()))
    out = simulate(model, tmp_path / "run", f"simulation.profile={engine_only}")
    assert out.returncode == 2 and "has no trainer section" in out.stderr, out.stderr[-2000:]
    assert os.listdir(tmp_path) == ["engine.yaml"]  # refused before anything was made


@pytest.mark.e2e
def test_a_run_whose_every_group_the_filter_turns_away_stops_with_its_pass_rate(model, tmp_path):
    """Simulated engines write random tokens, which the task's reward scores 0: no group's rewards differ."""
    out = simulate(
        model,
        tmp_path,
        "run.mode=sync",
        "run.steps=2",
        "rollout.filter_groups=zero_variance",
        "rollout.max_filtered_per_step=6",
    )
    assert out.returncode != 0
    assert "turned away" in out.stderr and "a pass rate of 0%" in out.stderr, out.stderr[-4000:]
    assert "checkpoint" in out.stderr and "run.resume=true continues from it" in out.stderr
    acct = accounting(tmp_path)
    assert acct["balanced"] and acct["trained"] == 0 and acct["dropped"]["filtered"] > 6


@pytest.mark.e2e
def test_the_simulated_agent_needs_a_profile_with_episodes_and_a_simulation(model, tmp_path):
    without = tmp_path / "single-turn.yaml"
    without.write_text(PROFILE.read_text().split("episodes:")[0])
    out = simulate(model, tmp_path / "run", f"simulation.profile={without}", "rollout.agent=simulated")
    assert out.returncode == 2 and "has no episodes section" in out.stderr, out.stderr[-2000:]
    out = simulate(model, tmp_path / "run", "simulation.profile=null", "rollout.agent=simulated", "sync.verify=false")
    assert out.returncode == 2 and "a simulation runs rollout.agent=simulated" in out.stderr, out.stderr[-2000:]
    assert os.listdir(tmp_path) == ["single-turn.yaml"]  # refused before anything was made


@pytest.mark.e2e
def test_a_real_run_refuses_simulated_engines_given_by_url(model, tmp_path):
    from tests.engine_server import running_server

    with running_server(model, tmp_path / "logs", "--simulate", str(PROFILE)) as url:
        out = subprocess.run(
            ["bash", str(RECIPE), f"run.dir={tmp_path / 'run'}", f"model.path={model}", f"engines.urls=[{url}]"],
            env=child_env(PYTHON=sys.executable),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert out.returncode == 2 and "is a simulated engine and this run is not a simulation" in out.stderr, out.stderr[
        -2000:
    ]
