"""The main job end to end under faults: engines, its rollout manager, its launcher, a trainer rank killed or hung,
and the run going on, stopping with one error or resuming with the same results."""

from __future__ import annotations

import json
import math
import os
import random
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from moerl.env import ended
from moerl.orchestrator.metrics import read_metrics
from tests.accounting import accounting, assert_async_run_accounted
from tests.jobs import (
    GROUPS,
    ended_well,
    engines_of,
    is_engine,
    job,
    kill_after_the_first_step,
    kill_tree,
    kill_tree_of,
    rows_so_far,
    start_job,
    start_until_checkpoint,
    the_error_after,
    wait_while_running,
)

SYNC_RUN = ["run.mode=sync", "run.steps=6", "run.save_every=2", "sync.verify=false"]


@pytest.fixture(scope="module")
def sync_run(demo_cache, tmp_path_factory) -> Path:
    """The demo's run directory in sync mode (:data:`SYNC_RUN`), run once: what runs that must end alike (resumed,
    colocated) are compared with. Its numbers do not depend on sync.verify, each prompt's sampling on its own seed."""
    run_dir = tmp_path_factory.mktemp("sync-run")
    out = job(demo_cache, run_dir, *SYNC_RUN)
    assert out.returncode == 0, out.stderr[-4000:]
    return run_dir


@pytest.mark.e2e
def test_an_async_run_survives_engines_killed_under_it(demo_cache, tmp_path, long_tailed):
    """Two replicas; one is SIGKILLed at a seeded random moment, and again once the job has restarted it and it is back
    in rotation: every step completes, no prompt is lost, and with sync.verify each update's engines (the restarted
    one from the update that brings it back) serve the trainer's weights. One run, under the default rollout.partial
    (in place): a generation lost with its replica is re-issued by the same code whatever partial says. Partial decides
    what an update does to rollouts in flight (aborted and regenerated: the run above) and, in async mode, whether the
    update flushes the engines' cache (not in place: SGLang refuses while requests run)."""
    rng = random.Random(0)
    steps = 22  # the second kill comes near step 9 here: room for a replica's restart twice as slow
    proc = start_job(
        demo_cache,
        tmp_path,
        "run.mode=async",
        f"run.steps={steps}",
        "run.save_every=0",
        "engines.replicas=2",
        "engines.health_interval_s=0.2",
        "engines.health_failures=2",
        *long_tailed,
    )

    try:
        killed_after = 0
        for kills in range(2):
            # Both replicas up and in rotation after the job restarted the last one killed: a row written between a kill
            # and the health checks that see it still reads both healthy, with the killed one's process already gone.
            # A kill during a broadcast also restarts the replica that took the bucket (it would wait in it for good).
            wait_while_running(
                proc,
                lambda killed_after=killed_after, kills=kills: any(
                    r["step"] > killed_after and r["engines/restarts"] >= kills and r["engines/healthy"] == 2
                    for r in rows_so_far(tmp_path)
                ),
                "the engines were back",
            )
            time.sleep(rng.uniform(0, 1))
            engines = engines_of(proc)
            assert len(engines) == 2
            killed_after = len(rows_so_far(tmp_path))
            os.killpg(rng.choice(engines).pid, signal.SIGKILL)
        done, stderr = ended_well(proc, tmp_path, steps)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    acct = accounting(tmp_path)
    assert acct["balanced"], acct
    assert acct["live"] == 0 and "engine_failure" not in acct["dropped"] and acct["trained"] == steps * GROUPS, acct
    # the two killed, and those a broadcast that one of them broke left waiting in it
    wedged = [
        line.split("restarting ", 1)[1].split(";")[0].split(", ")
        for line in stderr.splitlines()
        if "a broadcast failed after its bucket was announced: restarting" in line
    ]
    assert 2 <= done[-1]["engines/restarts"] <= 2 + sum(len(urls) for urls in wedged), (done[-1], wedged)
    assert done[-1]["prompts/dropped_engine_failure"] == 0, done[-1]
    assert any(r["engines/healthy"] < 2 for r in done)  # the kills were seen


@pytest.mark.e2e
def test_a_single_replica_run_waits_for_its_engine_and_it_returns_with_the_current_adapter(
    demo_cache, tmp_path, long_tailed
):
    """One replica, LoRA, sync mode. SIGKILLed as a step's rollouts start, the step waits while the job starts it again,
    and every rank stops for a catch-up sync that loads it the current adapter (verified) before it takes a request;
    later SIGSTOPped past a request's deadline and continued, it is probed back in. Every step completes, none lost."""
    steps = 6
    proc = start_job(
        demo_cache,
        tmp_path,
        "run.mode=sync",
        f"run.steps={steps}",
        "lora.enabled=true",
        "lora.rank=4",
        "engines.health_interval_s=0.2",
        "engines.health_failures=2",
        # far above a request's seconds on a loaded machine (a timeout there would retry until the budget is spent)
        "engines.request_timeout_s=15",
        *long_tailed,
    )
    manager_log = tmp_path / "logs" / "rollout_manager.log"

    def timeouts_logged() -> int:
        return len(re.findall(r"-> (suspect|dead) \(.*TimeoutError", manager_log.read_text()))

    def engine_after(step: int, restarts: int) -> psutil.Process:
        """The engine as the step after ``step`` starts its rollouts (sync mode: the metrics row ends a step), once the
        job has restarted it ``restarts`` times (a row can end a step before the health checks see a kill)."""
        wait_while_running(
            proc,
            lambda: any(
                r["step"] > step and r["engines/restarts"] == restarts and r["engines/healthy"] == 1
                for r in rows_so_far(tmp_path)
            ),
            "its engine was back",
        )
        (engine,) = engines_of(proc)
        return engine

    try:
        os.killpg(engine_after(1, restarts=0).pid, signal.SIGKILL)
        hung = engine_after(len(rows_so_far(tmp_path)), restarts=1)
        seen = timeouts_logged()
        hung.suspend()  # until its requests time out: they fail and wait for it
        wait_while_running(proc, lambda: timeouts_logged() > seen, "a request timed out")
        hung.resume()
        done, _ = ended_well(proc, tmp_path, steps)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    acct = accounting(tmp_path)
    assert (
        acct["balanced"]
        and acct["live"] == 0
        and "engine_failure" not in acct["dropped"]
        and acct["trained"] == steps * GROUPS
    ), acct
    assert done[-1]["engines/restarts"] == 1 and sum(r["sync/catch_ups"] for r in done) >= 1
    assert sum(r["rollout/retries_engine_failure"] for r in done) > 0  # both faults caught requests in flight
    # the restarted replica waited for its adapter; the killed one was probed out
    log = manager_log.read_text()
    assert "-> stale" in log and "-> dead" in log


@pytest.mark.e2e
def test_with_its_engines_gone_for_good_a_run_checkpoints_stops_with_one_error_and_resumes(demo_cache, tmp_path):
    """No restarts left: after engines.down_timeout_s the run writes a checkpoint (every prompt not trained pending) and
    stops with one error line; once engines are back, run.resume=true continues from that checkpoint."""
    proc = start_job(
        demo_cache,
        tmp_path,
        "run.mode=async",
        "run.steps=20",
        "run.save_every=0",
        "engines.max_restarts=0",
        "engines.down_timeout_s=3",
        "engines.health_interval_s=0.2",
    )

    def kill_the_engine():
        (engine,) = engines_of(proc)
        os.killpg(engine.pid, signal.SIGKILL)

    error = the_error_after(proc, tmp_path, 2, kill_the_engine)
    assert "engines.down_timeout_s" in error and "run.resume=true" in error, error
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    state = json.loads((checkpoint / "run_state.json").read_text())
    stopped_at = state["step"]
    assert stopped_at >= 2 and state["pending"] and accounting(tmp_path)["balanced"]
    out = job(demo_cache, tmp_path, "run.mode=async", f"run.steps={stopped_at + 1}", "run.resume=true")
    assert out.returncode == 0, out.stderr[-4000:]
    assert read_metrics(tmp_path)[-1]["step"] == stopped_at + 1 and accounting(tmp_path)["balanced"]


@pytest.mark.e2e
def test_with_its_rollout_manager_killed_a_run_checkpoints_and_stops_with_one_error(demo_cache, tmp_path):
    """The rollout manager dies (the kernel killed it for memory, say): rank 0 stops waiting for groups that will never
    come, writes a checkpoint (every prompt not trained pending) and stops with one error naming the manager. Whether
    any prompt is still in flight when it dies is a race with the manager's next issue (none was, once in CI); that
    pending prompts are kept whatever their state is shown by the run with its engines gone for good."""
    proc = start_job(demo_cache, tmp_path, "run.mode=async", "run.steps=20", "run.save_every=0")

    def kill_manager():
        (manager,) = [
            p for p in psutil.Process(proc.pid).children(recursive=True) if "moerl.cli.rollout_manager" in p.cmdline()
        ]
        manager.kill()

    error = the_error_after(proc, tmp_path, 1, kill_manager)
    assert "rollout manager process exited (killed by signal 9" in error and "run.resume=true" in error, error
    (checkpoint,) = (tmp_path / "checkpoints").iterdir()
    state = json.loads((checkpoint / "run_state.json").read_text())
    acct = state["accounting"]
    assert state["step"] >= 1 and len(set(state["pending"])) == acct["issued"] - acct["trained"] - sum(
        acct["dropped"].values()
    )
    assert accounting(tmp_path)["balanced"]


@pytest.mark.e2e
def test_a_run_whose_launcher_is_killed_stops_whole_and_resumes_with_the_same_results(demo_cache, sync_run, tmp_path):
    """SIGKILL of torchrun alone (an OOM killer's, a scheduler's hard kill, a timeout's --kill-after): its ranks run in
    sessions of their own that no signal of torchrun's reaches, so each must notice and stop (engines and rollout
    manager with it); one left running kept loading its weights into the engine the next job was given (found on an
    H100). Then run.resume=auto continues from the newest checkpoint to the same results as a run never killed."""
    steps, straight, killed = SYNC_RUN, sync_run, tmp_path / "killed"
    proc = start_until_checkpoint(demo_cache, killed, steps, 2)
    family = psutil.Process(proc.pid).children(recursive=True)
    try:
        assert any(is_engine(p) for p in family) and len([p for p in family if p.ppid() == proc.pid]) == 2
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's own session: its ranks are not in it
        proc.wait()
        deadline = time.monotonic() + 90  # a rank's teardown, or its end a minute after
        # orphans: a zombie is what an init that never reaps leaves
        while alive := [p for p in family if not ended(p.pid)]:
            assert time.monotonic() < deadline, [p.cmdline() for p in alive]
            time.sleep(0.5)
    finally:
        kill_tree_of(family)
    saved = sorted(
        int(d.name.split("_")[1]) for d in (killed / "checkpoints").glob("step_*") if (d / "run_state.json").exists()
    )
    assert saved and saved[-1] < 6, f"the ranks ran on without their launcher: checkpoints {saved}"
    out = job(demo_cache, killed, *steps, "run.resume=auto")
    assert out.returncode == 0, out.stderr[-4000:]
    a, b = read_metrics(straight), read_metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    # The same tokens, rewards and weights; float32 rounding may differ: the engine's log-probs (the behaviour policy of
    # the loss's correction) depend on what it batched them with, by ~1e-7, which moves a GRPO loss of ~0 by as much.
    for x, y in zip(a, b, strict=True):
        assert x["rollout/reward_mean"] == y["rollout/reward_mean"], (
            x["step"],
            x["rollout/reward_mean"],
            y["rollout/reward_mean"],
        )
        assert x["train/loss"] == pytest.approx(y["train/loss"], rel=1e-5, abs=1e-6), x["step"]
        assert x["train/grad_norm"] == pytest.approx(y["train/grad_norm"], rel=1e-5), x["step"]
        assert x["prompts/trained"] == y["prompts/trained"]
    acct = accounting(killed)
    assert acct["balanced"] and acct["dropped"] == {} and acct["trained"] == accounting(straight)["trained"]


@pytest.mark.e2e
def test_a_trainer_rank_killed_while_its_state_is_offloaded_leaves_no_process_behind(demo_cache, tmp_path):
    """Colocated, SIGKILL of trainer rank 1 once step 1 is saved and the engine is awake again, so the ranks' state is
    in host memory: torchrun stops rank 0, which tears down (engines and rollout manager stopped, accounting written;
    had it been killed too, they would die with it), no process of the job is left (the killed rank's helpers neither:
    its checkpoint writers' queue server) and the job exits non-zero. (A colocated run resumed from a checkpoint
    written while offloaded: the colocated test; a run resumed after a kill: the launcher's.)"""
    steps = ["run.mode=sync", "run.placement=colocated", "run.steps=2", "run.save_every=1", "sync.verify=false"]
    proc = start_job(demo_cache, tmp_path, *steps)
    log = tmp_path / "logs" / "embedded-0.log"

    def offloaded() -> bool:
        """Step 1 saved, and the engine's last memory call a resume: between its wake and the next step's release."""
        if not (tmp_path / "checkpoints" / "step_1" / "run_state.json").exists():
            return False
        calls = re.findall(r'"POST /(release|resume)_memory_occupation', log.read_text())
        return bool(calls) and calls[-1] == "resume"

    try:
        wait_while_running(proc, offloaded, "step 1's checkpoint with the engine awake")
        family = psutil.Process(proc.pid).children(recursive=True)
        ranks = {int(p.environ()["RANK"]): p for p in family if p.ppid() == proc.pid}  # torchrun's workers
        assert sorted(ranks) == [0, 1]
        children = [p for p in family if p.ppid() == ranks[0].pid]
        assert any(is_engine(p) for p in children) and any("moerl.cli.rollout_manager" in p.cmdline() for p in children)
        ranks[1].kill()
        assert proc.wait(timeout=120) != 0
        _, alive = psutil.wait_procs(family, timeout=30)
        assert alive == [], [p.cmdline() for p in alive]
        assert accounting(tmp_path)["balanced"]
    finally:
        if proc.poll() is None:
            kill_tree(proc)


@pytest.mark.e2e
def test_colocated_steps_release_the_engines_train_as_separate_ones_do_and_survive_a_kill_and_a_resume(
    demo_cache, sync_run, tmp_path
):
    """run.placement=colocated: each step pauses and releases the engine, trains, resumes its weights, hands the new
    ones over in shared memory, resumes its KV cache and continues; sync.verify finds the trainer's weights served
    after every push. The engine SIGKILLed once released is started again and the run goes on with nothing lost; the
    run resumed from its last checkpoint (written while the trainer's state was off the device) takes one step more.
    Every step's rewards and gradients are those of the same run with separate placement."""
    run_dir = tmp_path / "colocated"
    colocated = ["run.mode=sync", "run.placement=colocated"]
    proc = start_job(demo_cache, run_dir, *colocated, "run.steps=3")
    log = run_dir / "logs" / "embedded-0.log"

    def released() -> bool:
        return log.exists() and "/release_memory_occupation" in log.read_text()

    wait_while_running(proc, released, "the engine's first release")
    for engine in engines_of(proc):
        os.killpg(engine.pid, signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-4000:]
    assert read_metrics(run_dir)[-1]["engines/restarts"] == 1
    first_log = log.read_text()  # the restarted engine logs on in the same file; the resumed run's starts it again
    resumed = job(demo_cache, run_dir, *colocated, "run.steps=4", "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    ours, theirs = read_metrics(run_dir), read_metrics(sync_run)[:4]
    assert [r["step"] for r in ours] == [1, 2, 3, 4]
    for mine, other in zip(ours, theirs, strict=True):
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/grad_norm"):
            assert mine[key] == other[key], (key, mine["step"])
        # Engine and trainer agree here to rounding (k3 ~1e-13), and the engine's rounding may depend on which
        # requests it happened to batch together (it differed in the 14th digit once, under CI's load); a real
        # disagreement (weights, routing) reads far above 1e-12.
        assert mine["mismatch/k3_kl"] == pytest.approx(other["mismatch/k3_kl"], rel=0, abs=1e-12), mine["step"]
        assert all(mine[f"colocate/{phase}_seconds"] > 0 for phase in ("sleep", "wake", "push"))
        assert 0 < mine["colocate/step_fraction"] < 1 and mine["colocate/push_seconds"] == mine["sync/seconds"]
        # Rank 0's weights, gradients and optimizer state left its device: at EP2 it holds at least half the weights,
        # and as many bytes of gradients (fp32), Adam's two moments besides.
        assert mine["colocate/trainer_offloaded_bytes"] >= 2 * mine["sync/full_weight_bytes"]
    # Each step's sequence, as the engines took it; the resumed run's engine first takes the checkpoint's policy, awake.
    # The engine started again after the kill holds its memory and released nothing, so nothing is resumed on it (a
    # resume of what it did not release is refused, as SGLang's scheduler fails on one): it takes the first step's
    # policy awake, in the handover or in a catch-up before the second step's rollouts, then two steps' cycles.
    cycle = ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_tensor"] + [
        "/resume_memory_occupation"
    ]

    def calls(text: str) -> list[str]:
        return [c for c in re.findall(r'"POST (/\w+)', text) if c in cycle]

    _, killed, restarted = first_log.split("moerl.serve INFO serving")
    assert calls(killed)[0] == cycle[0]
    assert calls(restarted) == cycle[2:3] + cycle * 2, calls(restarted)
    assert calls(log.read_text()) == cycle[2:3] + cycle
    acct = accounting(run_dir)
    assert acct["balanced"] and acct["dropped"] == {} and acct["trained"] == 4 * GROUPS


@pytest.mark.e2e
def test_a_teacher_scores_every_sample_of_an_async_distillation_and_one_killed_comes_back(demo_cache, tmp_path):
    """teacher.model=demo (the demo model trained longer, made once) on an embedded engine of its own scores every
    sample as its group finishes; the student trains on pure distillation (reward weight 0: k1 as the advantage and a
    top-4 KL) under R3 and kept-set replay, asynchronously. Its replica SIGKILLed after the first step is started again;
    no group is lost (one the restart held past the staleness window is dropped as stale, never trained), each sample is
    scored once (a request each, besides those asked again), and the run ends."""
    run_dir = tmp_path / "run"
    proc = start_job(
        demo_cache, run_dir, "run.mode=async", "run.steps=3", "teacher.model=demo", "trainer.loss.distill.coef=1",
        "trainer.loss.distill.reward_weight=0", "trainer.loss.distill.top_k=4", "trainer.loss.distill.top_k_coef=0.5",
    )  # fmt: skip

    rows = kill_after_the_first_step(proc, run_dir, "addition-teacher")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["teacher_engines/restarts"] == 1
    for r in rows:
        assert r["teacher_engines/requests"] - r["teacher_engines/retries"] == r["rollout/samples"]
        assert r["teacher_engines/workers_lost"] == 0
        assert r["distill/teacher_logprob_mean"] < 0 and r["distill/topk_kl"] >= 0
        assert math.isfinite(r["distill/reverse_kl"]) and 0 <= r["distill/kept_set_exact"] <= 1
        assert 0 <= r["distill/kept_set_gap"] < math.inf
        assert r["distill/teacher_seconds"] > 0 and 0 < r["distill/teacher_share"] < 1
        assert r["staleness/max"] <= 1  # rollout.max_staleness's default
    assert_async_run_accounted(accounting(run_dir), trained=3 * GROUPS, depth=GROUPS)


@pytest.mark.e2e
def test_a_reward_model_scores_every_group_on_colocated_replicas_released_each_step_and_one_killed_comes_back(
    demo_cache, tmp_path
):
    """reward.model=demo: the tiny sequence classifier (made once) on an embedded engine of its own scores each group as
    it finishes, its score added to the task's (reward.combine=rule_plus_model). Colocated, the replica is paused and
    gives back its memory while the trainer trains, then takes its weights back from host memory and scores again. Its
    replica SIGKILLed after the first step is started again; no group is dropped, each is scored once (a request per
    group, besides those asked again), and the run ends."""
    run_dir = tmp_path / "run"
    proc = start_job(
        demo_cache, run_dir, "run.mode=sync", "run.placement=colocated", "run.steps=3", "reward.model=demo",
        "reward.combine=rule_plus_model",
    )  # fmt: skip

    rows = kill_after_the_first_step(proc, run_dir, "tiny-qwen3-reward-addition")
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward_engines/restarts"] == 1
    for r in rows:
        assert r["reward_engines/requests"] - r["reward_engines/retries"] == GROUPS
        # each reward is the task's (0 or 1) plus the model's score: the means differ by a share of solved samples
        solved = (r["rollout/reward_mean"] - r["reward_engines/score_mean"]) * r["rollout/samples"]
        assert solved == pytest.approx(r["reward_engines/rule_mean"] * r["rollout/samples"], abs=1e-6)
        assert solved == pytest.approx(round(solved), abs=1e-6) and r["reward_engines/score_mean"] != 0
    log = (run_dir / "logs" / "reward" / "embedded-0.log").read_text()
    assert log.count("moerl.serve INFO serving") == 2
    # A cycle each step, one before the kill and two after; every call answered 200.
    cycle = ["/pause_generation", "/release_memory_occupation", "/resume_memory_occupation", "/continue_generation"]
    calls = [(route, status) for route, status in re.findall(r'"POST (/\w+) [^"]*" (\d+)', log) if route in cycle]
    assert calls == [(route, "200") for route in cycle * 3], calls
    acct = accounting(run_dir)
    assert acct["balanced"] and acct["dropped"] == {} and acct["trained"] == 3 * GROUPS
