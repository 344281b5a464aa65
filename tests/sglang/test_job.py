"""The main job against SGLang 0.5.23 servers on the CPU, one job per set of properties: R3 and kept sets replayed, the
weights verified after every sync (SGLang's log-probs of a probe within 1e-4 of the trainer's: both in fp32), every
prompt accounted for.

- async, the broadcast over gloo, rollouts continued in place across updates, a server SIGKILLed and started again;
- async, through disk, rollouts aborted by an update and regenerated, rewarded by a reward model over /classify;
- colocated: released, handed over in shared memory within a weight-update session, resumed; a colocated SGLang
  teacher scores every sample for on-policy distillation, released and resumed with the engines;
- an agent's episodes over several turns, routing kept across turns (``moerl check-replay``), the weights pushed as
  deltas through moerl's weight loader in SGLang (``sync.delta``).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from moerl.orchestrator.metrics import read_metrics
from moerl.trainer.replay_trace import check_replay
from tests import REPO
from tests.accounting import accounting
from tests.jobs import GROUPS, job, on_policy, rows_so_far, start_job, wait_while_running

pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.usefixtures("sglang_python")]


def on_sglang(model: Path, *overrides: str) -> list[str]:
    return [f"model.path={model}", "engines.server=sglang", "trainer.replay.trace_samples=2", *overrides]


def sglang_servers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The SGLang servers the job started (each leads a process group of its own: its scheduler)."""
    found = []
    for p in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "sglang.launch_server" in p.cmdline() and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:  # gone meanwhile
            continue
    return found


def replayed_and_verified(rows: list[dict], steps: int) -> None:
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["routing/replayed"] == 1.0, r  # R3: every token routed as SGLang routed it
        assert r["sync/verify_mean_abs_delta"] < 1e-4, r  # SGLang serves the trainer's weights after each sync
    on_policy(rows[0])  # the first step's rollouts are the trainer's own policy's (version 0)


def test_async_over_the_broadcast_survives_its_sglang_server_killed(demo_cache, model, tmp_path):
    steps = 5
    proc = start_job(
        demo_cache,
        tmp_path,
        *on_sglang(model, "run.mode=async", f"run.steps={steps}", "sync.method=broadcast"),
        # long enough, and few enough at once, that updates meet rollouts in flight, continued in place
        "rollout.max_new_tokens=48",
        "rollout.stop_token_ids=[]",
        "engines.extra_args=[--max-running-requests,4]",
        "engines.health_interval_s=0.5",
        "engines.health_failures=2",
    )
    try:
        wait_while_running(proc, lambda: len(rows_so_far(tmp_path)) >= 2, "step 2", timeout_s=600)
        (server,) = sglang_servers(proc)
        os.killpg(server.pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-6000:]
    rows = read_metrics(tmp_path)
    replayed_and_verified(rows, steps)
    assert rows[-1]["engines/restarts"] >= 1
    assert sum(r["rollout/retries_engine_failure"] for r in rows) > 0  # the requests it held were re-issued
    assert sum(r["rollout/mixed_version_fraction"] for r in rows) > 0  # tokens of two versions in one rollout
    acct = accounting(tmp_path)
    assert acct["balanced"] and acct["live"] == 0 and acct["trained"] == steps * GROUPS, acct
    assert "engine_failure" not in acct["dropped"], acct  # lost with the server, re-issued, none dropped
    report = check_replay(tmp_path)
    assert report.ok, report.summary()


def test_async_through_disk_regenerates_aborted_rollouts_and_scores_with_reward_and_process_models(
    demo_cache, model, tmp_path
):
    """SGLang's policy and reward model; beside them a process reward model on the embedded engine (SGLang serves no
    per-token head), whose step scores the trainer assigns as min-form credit."""
    from transformers import AutoTokenizer

    from moerl.models.tiny import save_tiny_hf

    reward = save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "reward-model")
    prm = save_tiny_hf("Qwen3ForTokenClassification", tmp_path / "process-reward-model")
    tokenizer = AutoTokenizer.from_pretrained(prm)
    tokenizer.add_tokens(["<extra_0>"])
    tokenizer.save_pretrained(prm)
    steps = 3
    out = job(
        demo_cache,
        tmp_path / "run",
        *on_sglang(model, "run.mode=async", f"run.steps={steps}", "sync.method=disk", "rollout.partial=retry"),
        "rollout.max_new_tokens=48",
        "rollout.stop_token_ids=[]",
        "engines.extra_args=[--max-running-requests,2]",  # a step's rollouts are still running when its update comes
        f"reward.model={reward}",
        "reward.engines.server=sglang",
        f"reward.process.model={prm}",
        "trainer.loss.credit.rule=min",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    rows = read_metrics(tmp_path / "run")
    replayed_and_verified(rows, steps)
    assert sum(r["rollout/retries"] for r in rows) > 0  # aborted by an update, regenerated under the new weights
    assert all(r["rollout/mixed_version_fraction"] == 0 for r in rows)
    assert all(r["reward_engines/requests"] > 0 for r in rows)
    assert len({round(r["rollout/reward_mean"], 6) for r in rows}) > 1  # the reward model's scores
    for r in rows:  # every group's steps scored once, in one request to the process reward model
        assert r["process_engines/requests"] - r["process_engines/retries"] == GROUPS, r
        assert r["process/steps_mean"] >= 1 and 0 < r["process/step_reward_mean"] < 1, r
    assert accounting(tmp_path / "run")["balanced"]


def test_colocated_releases_hands_over_and_resumes_and_distils_from_a_colocated_teacher(demo_cache, model, tmp_path):
    from moerl.models.tiny import ALL_SPARSE, save_tiny_hf

    teacher = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "teacher", seed=4, **ALL_SPARSE)
    steps = 3
    out = job(
        demo_cache,
        tmp_path / "run",
        *on_sglang(model, "run.mode=sync", f"run.steps={steps}", "run.placement=colocated"),
        f"teacher.model={teacher}",
        "teacher.engines.server=sglang",
        "trainer.loss.distill.coef=1",
        "trainer.loss.distill.top_k=4",
        "trainer.loss.distill.top_k_coef=0.5",
    )
    assert out.returncode == 0, out.stderr[-6000:]
    rows = read_metrics(tmp_path / "run")
    replayed_and_verified(rows, steps)
    for r in rows:
        assert r["colocate/push_seconds"] > 0 and r["colocate/trainer_offloaded_bytes"] > 0, r
        on_policy(r)  # every step: sync
        # SGLang's teacher scored every sample once; another random model is far from the student
        assert r["teacher_engines/requests"] - r["teacher_engines/retries"] == r["rollout/samples"], r
        assert r["distill/reverse_kl"] > 0.1 and r["distill/teacher_logprob_mean"] < 0 and r["distill/topk_kl"] > 0, r
    log = next((tmp_path / "run" / "logs").glob("sglang-*.log")).read_text()
    for route in ("/release_memory_occupation", "/begin_weight_update", "/update_weights_from_tensor"):
        assert f'POST {route} HTTP/1.1" 200' in log, route
    assert 'POST /update_weights_from_tensor HTTP/1.1" 4' not in log
    # the teacher's replica gives back its memory for each trainer's phase and takes it back after, every call a 200
    teacher_log = next((tmp_path / "run" / "logs" / "teacher").glob("sglang-*.log")).read_text()
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        assert teacher_log.count(f'POST {route} HTTP/1.1" 200') == steps, route


def test_an_agents_episodes_keep_their_routing_across_turns(demo_cache, calc_model, tmp_path):
    steps = 3
    out = job(
        demo_cache,
        tmp_path,
        *on_sglang(calc_model, "run.mode=async", f"run.steps={steps}", "sync.delta=true"),
        "--config",
        str(REPO / "recipes" / "qwen_moe_agent.yaml"),
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-6000:]
    rows = read_metrics(tmp_path)
    replayed_and_verified(rows, steps)  # verified: the deltas leave SGLang holding the trainer's weights
    # each push a delta of the last (in fp32 nearly every element a step moves goes: most tensors whole within it); a
    # step whose groups all scored alike has no gradient and moves nothing
    assert [r["sync/whole"] for r in rows] == [0.0] * steps, rows
    assert all(r["sync/changed_fraction"] > 0 for r in rows if r["train/grad_norm"] > 0), rows
    assert max(r["episode/turns_mean"] for r in rows) > 1 and sum(r["episode/tool_calls"] for r in rows) > 0
    report = check_replay(tmp_path)
    assert report.ok and report.steps == steps, report.summary()
