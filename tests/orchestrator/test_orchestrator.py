"""The main job end to end on the tiny model: each mode, its recipes, bad configs; and its parts in this process."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from moerl.env import child_env
from moerl.orchestrator.metrics import plot, read_metrics
from tests import REPO
from tests.accounting import accounting
from tests.jobs import job, on_policy

REQUIRED = (
    "step",
    "mode",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "train/loss",
    "routing/agreement",
    "mismatch/k3_kl",
    "staleness/max",
    "sync/seconds",
    "time/step_seconds",
    "time/trainer_idle_fraction",
    "prompts/trained",
    "prompts/dropped",
)


@pytest.mark.e2e
@pytest.mark.parametrize("mode, steps, groups", [("sync", 10, 8), ("periodic", 4, 4), ("async", 3, 4)])
def test_each_mode_trains_with_bounded_staleness_and_every_prompt_accounted(
    demo_cache, tmp_path, engine_bound, mode, steps, groups
):
    staleness = 1
    extra = engine_bound if mode == "async" else []  # updates meet rollouts in flight, continued in place
    if mode == "periodic":
        extra = [
            "trainer.replay.trace_samples=2",
            # and dynamic sampling: a group with one reward throughout is replaced
            "rollout.filter_groups=zero_variance",
            # and the length-aware schedule: each completion cut at a token (the demo answers in 2 to 4), 4 requests
            # a replica at most, the rest queued in the manager, a request predicted 2 tokens in all a tail request
            # (2 at most a replica running one), run uncut; the trainer replays and scores what sampled
            "rollout.schedule.policy=length_aware",
            "rollout.schedule.chunk_tokens=1",
            "rollout.schedule.max_running=4",
            "rollout.schedule.tail_tokens=2",
            "rollout.schedule.tail_running=2",
        ]
    out = job(
        demo_cache,
        tmp_path,
        f"run.mode={mode}",
        f"run.steps={steps}",
        f"rollout.max_staleness={staleness}",
        f"rollout.groups_per_step={groups}",
        *extra,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["mode"] == mode
        assert r["staleness/max"] <= (staleness if mode == "async" else 0)
        assert r["routing/replayed"] == 1.0  # R3: every token routed as the engine routed it
        assert r["rollout/samples"] == groups * 8
        assert r["rollout/retries"] == 0
    if mode == "async":
        # continued in place: tokens keep their versions
        assert sum(r["rollout/mixed_version_fraction"] for r in rows) > 0
        # so the mismatch splits into tokens of the current policy and older ones
        assert any(r["mismatch/k3_kl_lagged"] == r["mismatch/k3_kl_lagged"] for r in rows)
    else:
        for r in rows:
            on_policy(r)
        rewards = [r["rollout/reward_mean"] for r in rows]
        assert rewards[0] > 0  # the warmed-up tiny model starts above zero reward
        if mode == "sync":  # deterministic: the demo's reward visibly rises
            assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.15, rewards
    acct = accounting(tmp_path)
    assert acct["balanced"] and acct["live"] == 0
    assert acct["trained"] == steps * groups == rows[-1]["prompts/trained"]
    assert acct["issued"] == acct["trained"] + sum(acct["dropped"].values())
    if mode == "sync":
        assert acct["dropped"] == {}
    if mode == "periodic":
        assert set(acct["dropped"]) <= {"filtered"}
        assert sum(r["rollout/filtered_groups"] for r in rows) == acct["dropped"].get("filtered", 0)
        assert all(r["rollout/zero_variance_groups"] == 0 for r in rows)
        # a continuation has decoded a token at least, so it is predicted 2 in all: a tail request, run to its
        # completion's end
        first, *later = rows
        assert first["rollout/tail_requests"] >= first["rollout/continued_requests"] > 0
        # from the second step the first step's completions (32, the median's minimum) predict every group at the
        # demo's 2 tokens or more: each request is a tail request from its start, and no completion is cut
        for r in later:
            assert r["rollout/continued_requests"] == 0 and r["rollout/tail_requests"] == r["rollout/samples"]
    png = plot(tmp_path)
    assert png.stat().st_size > 10_000
    assert any((tmp_path / "tensorboard").iterdir())
    if mode == "periodic":  # the job's replay trace, checked as a user would
        from moerl.trainer.replay_trace import check_replay

        report = check_replay(tmp_path)
        replicas = 2  # the demo's EP2 ranks are two data-parallel replicas
        assert report.ok and report.steps == steps and report.samples == 2 * replicas * steps, report.summary()


@pytest.mark.e2e
def test_lora_job_moves_adapters_only(demo_cache, tmp_path):
    """lora.enabled=true through the same recipe: adapters pushed after every step under a new name; on-policy
    (sync, fp32) the engine with the adapter reproduces the trainer's log-probs, so it serves what was trained."""
    out = job(
        demo_cache,
        tmp_path,
        "run.mode=sync",
        "run.steps=3",
        "lora.enabled=true",
        "lora.rank=4",
        "trainer.optim.lr=5e-2",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert 0 < r["sync/bytes"] < r["sync/full_weight_bytes"] / 5
        assert r["sync/pause_seconds"] == 0.0 and r["staleness/max"] == 0
        on_policy(r)
    assert any(r["train/grad_norm"] > 0 for r in rows)  # lr 5e-2 may leave a step whose groups all score alike
    assert accounting(tmp_path)["balanced"]
    manager_log = (tmp_path / "logs" / "rollout_manager.log").read_text()
    assert re.search(r"new requests use adapter moerl-lora-\w+-v2 ", manager_log) and re.search(
        r"unloaded adapter moerl-lora-\w+-v1:", manager_log
    )


@pytest.mark.e2e
def test_the_agent_recipe_trains_on_multi_turn_episodes_replayed_across_turns(demo_cache, tmp_path, calc_model):
    """The agent recipe as a user runs it, in async mode with R3 and the sampling mask (on the episode tests' model,
    not the demo's, which takes minutes to warm up): tool-calling episodes of several turns, their context masked, and
    the replay trace of every step checked: each fed position of a multi-turn sample (context included) routed as the
    rollout recorded it, each turn's routing appended, none overwritten."""
    from moerl.trainer.replay_trace import check_replay

    out = job(
        demo_cache,
        tmp_path,
        "--config",
        str(REPO / "recipes" / "qwen_moe_agent.yaml"),
        "run.steps=3",
        "trainer.replay.trace_samples=4",
        f"model.path={calc_model}",
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["mode"] == "async" and r["routing/replayed"] == 1.0 and r["episode/failures"] == 0
        # one sample per episode, and one more per fork (a sampled tool call the template serialises otherwise)
        assert r["rollout/samples"] == 4 * 8 + r["episode/forks"]
    assert sum(r["episode/tool_calls"] for r in rows) > 0 and max(r["episode/turns_mean"] for r in rows) > 1
    assert max(r["episode/env_token_fraction"] for r in rows) > 0
    report = check_replay(tmp_path)
    assert report.ok and report.steps == 3, report.summary()
    assert accounting(tmp_path)["balanced"]


@pytest.mark.e2e
def test_rollouts_aborted_by_a_weight_update_are_regenerated(demo_cache, tmp_path, engine_bound):
    out = job(demo_cache, tmp_path, "run.mode=async", "run.steps=3", "rollout.partial=retry", *engine_bound)
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert sum(r["rollout/retries"] for r in rows) > 0
    assert all(r["rollout/mixed_version_fraction"] == 0 for r in rows)  # every sample from one policy version
    assert all(r["staleness/max"] <= 1 for r in rows) and accounting(tmp_path)["balanced"]


def test_a_resume_takes_the_newest_checkpoint_whose_run_state_was_written(tmp_path):
    """The run state is written last, so a step directory without it is one a kill cut short; numbers compare as
    numbers (step_10 is newer than step_9)."""
    from moerl.orchestrator.run_state import RUN_STATE, latest_checkpoint

    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((2, True), (9, True), (10, True), (12, False)):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / f"step_{step}" / RUN_STATE).write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_10"


def test_a_checkpoint_cut_short_is_replaced_when_its_step_is_saved_again(tmp_path, monkeypatch):
    """The resumed run reaches the step again: what the kill left is removed first (the trainer's save refuses a
    directory that exists). A complete checkpoint of the same step (a stop in the step after it) keeps its weights
    and gets the new run state."""
    from types import SimpleNamespace

    from moerl.orchestrator import run_state

    monkeypatch.setattr(run_state, "on_lead", lambda call, what: call())  # one process: rank 0's part runs here

    def save(out: Path) -> None:
        out.mkdir(parents=True)  # as Trainer.save: exist_ok=False
        (out / "weights").write_text(f"saved {len(saves)}")
        saves.append(out)

    saves: list[Path] = []
    trainer = SimpleNamespace(version=3, save=save)
    rollouts = SimpleNamespace(
        drain=lambda: None, cursor=12, pending=lambda: [7, 9], acct=SimpleNamespace(state=lambda: {"issued": 14})
    )
    cut = tmp_path / "checkpoints" / "step_3"
    cut.mkdir(parents=True)
    (cut / "shard.distcp").write_text("half-written")
    run_state.save_checkpoint(trainer, rollouts, tmp_path)
    assert sorted(p.name for p in cut.iterdir()) == [run_state.RUN_STATE, "weights"] and len(saves) == 1
    rollouts.pending = lambda: [9]
    run_state.save_checkpoint(trainer, rollouts, tmp_path)
    assert len(saves) == 1 and (cut / "weights").read_text() == "saved 0"
    assert json.loads((cut / run_state.RUN_STATE).read_text()) == {
        "step": 3,
        "cursor": 12,
        "pending": [9],
        "accounting": {"issued": 14},
    }


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory) -> Path:
    """Model directories a user might point model.path at by mistake."""
    from moerl.models.tiny import save_tiny_hf

    root = tmp_path_factory.mktemp("bad-models")
    gelu = save_tiny_hf("Qwen3MoeForCausalLM", root / "gelu")
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"architectures": [')
    return root


@pytest.mark.e2e
@pytest.mark.parametrize(
    "override, message",
    [
        ("run.bogus=1", "run.bogus"),
        ("run.trainer_ranks=3", "world size 3 is not divisible"),
        ("engines.urls=[http://127.0.0.1:9]", "http://127.0.0.1:9 unreachable"),
        ("run.mode=fast", "run.mode='fast'"),
        ("lora.rank=0", "lora.rank=0"),
        ("model.path={bad}/gelu", "hidden_act='gelu': only 'silu' is supported"),
        ("model.path={bad}/broken", "config.json: not valid JSON"),
    ],
)
def test_bad_config_fails_fast_with_one_clear_error(demo_cache, tmp_path, bad_models, override, message):
    start = time.monotonic()
    out = job(demo_cache, tmp_path, override.format(bad=bad_models), timeout=180)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors and message in errors[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]  # checked before torchrun starts a rank
    assert not (tmp_path / "metrics.jsonl").exists()
    assert time.monotonic() - start < 120


@pytest.mark.e2e
def test_engines_given_by_url_get_the_runs_weights_before_the_first_rollout(demo_cache, tmp_path, long_tailed):
    """An engine given by URL may hold anything (here another model of the same shape, as after an earlier run):
    the job pushes its own weights before the first request; sync.verify checks the engine at version 0."""
    from moerl.models.tiny import save_tiny_hf
    from tests.engine_server import running_server

    other = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "other", seed=1)
    with running_server(other, tmp_path / "engine-logs") as url:
        run = job(demo_cache, tmp_path / "run", *long_tailed, f"engines.urls=[{url}]", "run.mode=sync", "run.steps=1")
    assert run.returncode == 0, run.stderr[-3000:]
    assert accounting(tmp_path / "run")["balanced"]


def test_verify_is_as_tight_as_the_engines_reported_precision_allows():
    from moerl.orchestrator.components import verify_tolerance
    from moerl.orchestrator.config import load_config

    cfg = load_config(None, ["trainer.dtype=float32", "engines.dtype=float32"])
    assert verify_tolerance(cfg) == 1e-4
    assert verify_tolerance(cfg, ["float32"]) == 1e-4
    # an engine given by URL in bf16, whatever engines.dtype says
    assert verify_tolerance(cfg, ["float32", "bfloat16"]) == 5e-2
    assert verify_tolerance(cfg, ["auto"]) == 5e-2  # SGLang's auto: fp16 or bf16
    assert verify_tolerance(load_config(None, ["sync.verify_tolerance=0.3"]), ["float32"]) == 0.3


@pytest.mark.e2e
def test_a_directory_holding_a_run_is_continued_only_on_request(demo_cache, tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    out = job(demo_cache, tmp_path, timeout=180)
    assert out.returncode != 0
    assert any(
        "already holds a run: pass run.resume=true" in line
        for line in out.stderr.splitlines()
        if line.startswith("error:")
    )
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_job_messages_are_typed_and_anything_else_is_refused(tmp_path):
    from moerl.orchestrator.messages import EVENTS, ORDERS, Generate, GroupDone, ManagerSpec, Stop, checked

    assert checked(Generate(3), ORDERS) == Generate(3) and checked(Stop(), ORDERS) == Stop()
    with pytest.raises(
        TypeError, match="unexpected message dict: expected one of Generate, Updating, Served, Restarting, Stop"
    ):
        checked({"cmd": "generate", "groups": 3}, ORDERS)
    with pytest.raises(TypeError, match="unexpected message Generate"):
        checked(Generate(1), EVENTS)  # an order is not an event
    assert checked(GroupDone(4, [], 0, 1.5), EVENTS).index == 4
    spec = ManagerSpec(
        config="c.yaml", hf_dir="hf", urls=["http://a"], orders="tcp://o", events="tcp://e", cursor=7, reissue=[3, 5]
    )
    spec.write(tmp_path / "spec.json")
    assert ManagerSpec.read(tmp_path / "spec.json") == spec and not (tmp_path / "spec.json.partial").exists()


@pytest.mark.parametrize(
    "placement, failing, events",
    [
        ("separate", None, ["engines launched", "trainer built", "engines waited for", "sync made"]),
        ("colocated", None, ["trainer built", "room made", "engines started", "sync made"]),
        ("separate", "trainer", ["engines launched", "trainer failed"]),
    ],
)
def test_engines_on_gpus_of_their_own_load_while_the_trainer_is_built_and_stop_with_the_job_whatever_fails(
    monkeypatch, tmp_path, placement, failing, events
):
    """The job's phases on rank 0, their collaborators recorded: engines on GPUs of their own are launched before the
    trainer is built and waited for after; colocated ones start once the trainer made room. Whatever fails from the
    engines' launch on, the teardown kills the rollout manager and stops the engines."""
    from types import SimpleNamespace

    from moerl.orchestrator import job as job_module
    from moerl.orchestrator.config import load_config

    seen: list[str] = []

    class Failed(Exception):
        pass

    def make_trainer(cfg, hf, mcore):
        seen.append("trainer failed" if failing == "trainer" else "trainer built")
        if failing == "trainer":
            raise Failed
        return SimpleNamespace(version=0, hf_config={})

    def make_sync(*args):
        seen.append("sync made")
        raise Failed  # the phases after it are other tests'

    def start_engines(cfg, placement, hf, run_dir, local_ranks, wait):
        seen.append("engines started" if wait else "engines launched")
        return ["http://e"], None

    for name, value in {
        "check_layout": lambda cfg, world: None,
        "init_process_group": lambda timeout_s: None,
        "ranks_agree": lambda error, what: None,
        "on_lead": lambda call, what: call(),
        "dist": SimpleNamespace(broadcast_object_list=lambda box, src: None),
        "preflight": lambda cfg, world: None,
        "prepare_model": lambda cfg: (str(tmp_path / "hf"), None),
        "make_trainer": make_trainer,
        "full_weight_bytes": lambda trainer: 0,
        "verify_tolerance": lambda cfg: 0.0,
        "latest_checkpoint": lambda run_dir: None,
        "start_manager": lambda run_dir: SimpleNamespace(kill=lambda: seen.append("manager killed")),
        "start_engines": start_engines,
        "start_scorer_engines": lambda *args: None,
        "make_sync": make_sync,
    }.items():
        monkeypatch.setattr(job_module, name, value)
    job = job_module.Job(load_config(None, ["run.mode=sync", f"run.placement={placement}", f"run.dir={tmp_path}"]))
    monkeypatch.setattr(job.engines, "wait_started", lambda cfg: seen.append("engines waited for"))
    monkeypatch.setattr(job.engines, "stop", lambda: seen.append("engines stopped"))
    monkeypatch.setattr(job.placement, "make_room", lambda trainer: seen.append("room made"))
    with pytest.raises(Failed):
        job.run()
    assert seen == [*events, "manager killed", "engines stopped"]


@pytest.mark.e2e
def test_a_resumed_lora_run_samples_with_its_own_adapter_from_the_first_request(monkeypatch):
    """The adapter a resumed run's sync loads at start is what the rollout manager's first requests name."""
    from types import SimpleNamespace

    from moerl.orchestrator import job as job_module
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.lead import Lead

    ordered = []

    class Sync:
        adapter, engines = None, ["http://a"]

        def start(self, trainer, engines_hold_it):
            self.adapter = None if engines_hold_it else "moerl-lora-v3"

        def served(self, version):
            return None, self.adapter

    class Rollouts:
        def served(self, weight_version, engines, adapter, version, also):
            ordered.append(("served", weight_version, engines, adapter, version, also))

        def order(self, groups):
            ordered.append(("generate", groups))

    def start_rollouts(self):
        self.sync = Sync()
        self.lead = Lead.__new__(Lead)  # rank 0's part, without the processes it starts
        self.lead.sync, self.lead.rollouts = self.sync, Rollouts()

    job = job_module.Job(load_config(None, ["run.mode=async", "run.steps=3", "sync.verify=false"]))
    monkeypatch.setattr(
        job_module.Job, "setup", lambda self: setattr(self, "trainer", SimpleNamespace(version=3)) or True
    )
    monkeypatch.setattr(job_module.Job, "start_rollouts", start_rollouts)
    monkeypatch.setattr(job_module.Job, "teardown", lambda self: None)
    job.run()
    assert ordered[:2] == [
        ("served", None, ["http://a"], "moerl-lora-v3", 3, False),
        ("generate", job.cfg.rollout.outstanding),
    ]


@pytest.mark.e2e
def test_a_catch_up_of_full_weights_leaves_the_others_in_rotation_and_forgets_what_it_missed():
    """A catch-up sync to the replicas back while none serves: the manager hears it added them to those holding the
    policy (full weights: the others hold it too), and one it missed is not counted as caught up."""
    from types import SimpleNamespace

    from moerl.orchestrator import job as job_module
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.lead import Lead

    served = []

    class Sync:
        adapter, reached, engines = None, True, ["http://a", "http://b"]

        def update(self, trainer, only=None):
            self.engines = [url for url in only if url != "http://c"]  # "c" went again before the sync
            return SimpleNamespace(seconds=0.1)

        def served(self, version):
            return str(version), None

    job = job_module.Job(load_config(None, ["run.mode=async", "sync.verify=false"]))
    job.sync, job.trainer = Sync(), SimpleNamespace(version=4)
    job.lead = lead = Lead.__new__(Lead)  # rank 0's part, without the processes it starts
    lead.sync, lead.rollouts, lead.catch_ups = (
        job.sync,
        SimpleNamespace(served=lambda *args, **kw: served.append((args, kw))),
        0,
    )
    lead.back, lead.caught_up = ["http://b", "http://c"], {"http://a", "http://b", "http://c"}
    job.interlude(job_module.Pause.CATCH_UP)
    assert served == [(("4", ["http://b"], None, 4), {"also": True})]
    assert lead.caught_up == {"http://a", "http://b"} and lead.catch_ups == 1


def test_a_reward_replica_that_fails_to_wake_is_killed_and_one_that_fails_to_release_serves_on():
    """Colocated reward replicas: one whose wake fails would stay paused or without its memory, and the manager's
    scoring waits on a paused replica that answers, so the placement kills it for revive to start it again; one whose
    release fails after its pause is continued, serving on with its memory, rather than left paused for the step."""
    from moerl.engines.client import EngineError
    from moerl.orchestrator.placement import Colocated, _release_memory

    killed: dict[str, list[str]] = {"reward": [], "teacher": []}

    def pool(key: str, url: str) -> SimpleNamespace:
        return SimpleNamespace(urls=[url], kill=lambda urls: killed[key].extend(urls) or urls)

    colocated = Colocated()
    colocated.released = {"http://127.0.0.1:9"}  # nothing listens on the discard port: its resume fails
    # a teacher's replica, not released, is left alone: each pool kills its own replicas only
    colocated.before_generation([pool("reward", "http://127.0.0.1:9"), pool("teacher", "http://127.0.0.1:7")])
    assert killed == {"reward": ["http://127.0.0.1:9"], "teacher": []} and colocated.released == set()

    calls = []

    class Replica:
        async def pause(self, mode):
            calls.append(f"pause {mode}")

        async def release_memory(self):
            calls.append("release")
            raise EngineError("http://r", "/release_memory_occupation refused (400): busy", 400)

        async def resume(self):
            calls.append("continue")

    with pytest.raises(EngineError):
        asyncio.run(_release_memory(Replica()))
    assert calls == ["pause retract", "release", "continue"]


def test_a_steps_machine_busy_fraction_counts_guest_time_once_and_iowait_as_idle(monkeypatch):
    import collections
    import os

    import psutil

    from moerl.orchestrator.metrics import CpuMeter

    fields = "user nice system idle iowait irq softirq steal guest guest_nice"
    times = collections.namedtuple("scputimes", fields)
    start = times(100, 0, 50, 800, 50, 0, 0, 0, 20, 0)
    # 300 s user (100 of it a guest's, which Linux counts in user too), 100 system, 50 stolen, 200 idle, 50 iowait
    end = times(400, 0, 150, 1000, 100, 0, 0, 50, 120, 0)
    readings = iter([start, end])
    monkeypatch.setattr(psutil, "cpu_times", lambda: next(readings))
    meter = CpuMeter(os.getpid(), SimpleNamespace(cpu_s=0.0))
    meter.start_step()
    assert meter.step_metrics(1.0)["cpu/machine_busy_fraction"] == pytest.approx(450 / 700)


def test_plot_draws_several_runs_on_the_same_axes(tmp_path):
    from moerl.cli.plot import main as plot_main

    for name, slope in (("R3", 0.1), ("off", 0.05)):
        (tmp_path / name).mkdir()
        rows = [
            {"step": s, "mode": "sync", "rollout/reward_mean": slope * s, "mismatch/k3_kl": 1e-4 / s}
            for s in range(1, 6)
        ]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = plot(tmp_path / "R3")
    assert plot_main([str(tmp_path / "R3"), str(tmp_path / "off")]) == 0
    both = tmp_path / "compare.png"
    assert (
        one == tmp_path / "R3" / "curves.png" and both.stat().st_size > 10_000 and both.read_bytes() != one.read_bytes()
    )
    (tmp_path / "again" / "R3").mkdir(parents=True)
    (tmp_path / "again" / "R3" / "metrics.jsonl").write_text((tmp_path / "R3" / "metrics.jsonl").read_text())
    with pytest.raises(ValueError, match="distinct directory names"):
        plot([tmp_path / "R3", tmp_path / "again" / "R3"])


def test_an_ablation_grid_is_every_combination_the_first_axis_slowest_and_each_run_named_by_its_values():
    from moerl.orchestrator.ablate import AblationError, combinations, run_name

    combos = combinations(
        ["trainer.replay.routing=off,R2,R3", "trainer.replay.sampling_mask=true,false", "data.path=a/b.jsonl"]
    )
    assert [run_name(c) for c in combos] == [
        f"routing-{r}+sampling_mask-{m}+path-a_b.jsonl" for r in ("off", "R2", "R3") for m in ("true", "false")
    ]
    assert combos[1] == ["trainer.replay.routing=off", "trainer.replay.sampling_mask=false", "data.path=a/b.jsonl"]
    for bad in (["trainer.replay.routing"], ["=off,R3"], ["trainer.replay.routing=,"], ["a=1", "a=2"]):
        with pytest.raises(AblationError):
            combinations(bad)


def test_an_ablation_table_key_is_a_metric_or_a_metric_and_its_std(tmp_path):
    from moerl.orchestrator.ablate import RECIPE, AblationError, ablate

    with pytest.raises(AblationError, match=r"--keys train/grad_norm:var: a key is a metric, or a metric and :std"):
        ablate(tmp_path / "out", ["run.seed=0,1"], [], RECIPE, 3, ("train/grad_norm:std", "train/grad_norm:var"))
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_an_ablation_of_credit_rules_runs_each_on_the_same_seeds_and_writes_the_table_and_the_overlay(
    demo_cache, tmp_path
):
    """End to end, the process-reward demo (the sums task, each step scored by its tiny process reward model on an
    embedded engine of its own) under credit rules, the grid's product being the test above: each run gets its rule,
    the same first batch, its steps scored, its row in the table (a standard deviation column too) and its curve in
    the overlay."""
    from omegaconf import OmegaConf

    out = tmp_path / "ablation"

    def ablate(*grid: str) -> subprocess.CompletedProcess:
        grids = [arg for axis in grid for arg in ("--grid", axis)]
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "moerl.cli",
                "ablate",
                "--out",
                str(out),
                "--last",
                "2",
                "--keys",
                "rollout/reward_mean",
                "process/step_reward_mean",
                "train/grad_norm:std",
                *grids,
                "--",
                "--config",
                str(REPO / "recipes" / "qwen_moe_process.yaml"),
                f"run.cache_dir={demo_cache}",
                "run.mode=sync",
                "run.steps=2",
                "rollout.groups_per_step=2",
            ],
            env=child_env(PYTHON=sys.executable),
            capture_output=True,
            text=True,
            timeout=900,
            cwd=REPO,
        )

    bad = ablate("trainer.loss.credit.rule=outcome,nope")
    assert (
        bad.returncode == 2 and "rule-nope" in bad.stdout and "nope" in bad.stdout.splitlines()[-1] and not out.exists()
    )
    # two rules of the three (each rule's credit is checked on hand values in tests/trainer/test_credit.py)
    done = ablate("trainer.loss.credit.rule=outcome,min")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    names = ["rule-outcome", "rule-min"]
    first_rewards = set()
    for name in names:
        rows = read_metrics(out / name)
        assert [r["step"] for r in rows] == [1, 2]
        first_rewards.add((rows[0]["rollout/reward_mean"], rows[0]["process/step_reward_mean"]))
        for row in rows:  # every response cut into its lines, each scored by the process reward model
            assert row["process/steps_mean"] >= 1 and 0 <= row["process/step_reward_mean"] <= 1
            assert row["process_engines/requests"] == 2 and row["process_engines/retries"] == 0
        assert name == f"rule-{OmegaConf.load(out / name / 'config.yaml').trainer.loss.credit.rule}"
    assert (
        len(first_rewards) == 1
    )  # the same seeds and data: every run's first batch is the same rollouts, scored alike
    table = (out / "ablation.md").read_text().splitlines()
    assert [line.split(" | ")[0].lstrip("| ") for line in table[4:]] == names
    assert all(float(line.rstrip(" |").rsplit(" | ", 1)[1]) >= 0 for line in table[4:])  # the std of the grad norm
    assert (out / "ablation.png").stat().st_size > 10_000


@pytest.mark.e2e
def test_parts_rank_0_takes_alone_end_together_on_every_rank(tmp_path):
    """Rank 0 alone starts the engines and the rollout manager, takes in rollouts, records metrics and writes the run
    state of a checkpoint; whatever fails there must stop every rank, which otherwise waits in its next collective
    (under NCCL until the 6 h timeout where no torchrun ends it). The rollout manager gone is raised as itself on every
    rank (each writes its checkpoint); anything else rank 0 raises as itself and the others as one pointing to it."""
    from moerl.megatron.launch import run_ranks
    from tests.workers import what_each_rank_raises_from_parts_rank_0_takes_alone

    lead, other = run_ranks(what_each_rank_raises_from_parts_rank_0_takes_alone, 2, str(tmp_path), timeout_s=120)
    assert [kind for kind, _, _ in lead] == ["", "RolloutManagerLost", "OSError", "RolloutError"]
    assert lead[0][1] == "rank 0's" and "reward function raised" in lead[3][1] and not any(r for _, _, r in lead)
    assert [kind for kind, _, _ in other] == ["", "RolloutManagerLost", "MoerlError", "MoerlError"] and other[0][
        1
    ] is None
    assert all(relayed for _, _, relayed in other[1:])
    assert other[2][1] == "global rank 0 failed in recording the step's metrics (its error says why)"
    assert f"writing the run state of checkpoint {tmp_path / 'checkpoints' / 'step_2'}" in other[3][1]


def test_the_manager_keys_prompts_by_policy_and_sends_none_while_an_update_is_under_way(model, tmp_path):
    """The rollout manager keys each request's prefix cache (extra_key) by the weight version it is issued under, and
    sends none while an update is under way (Updating until Served): a request sent then would wait on a paused engine
    and start under the new weights, keyed to the old version's cache."""

    from aiohttp import web

    from moerl.orchestrator.messages import Generate, GroupDone, Served, Updating
    from tests.engine_server import serving, two_token_answer
    from tests.rollout_manager import manager_run

    config = json.loads((model / "config.json").read_text())
    layers, topk = config["num_hidden_layers"], config["num_experts_per_tok"]
    bodies: list[dict] = []

    async def generate(request):
        body = await request.json()
        bodies.append(body)
        return two_token_answer(body, body["extra_key"].rsplit("-v", 1)[1], layers, topk, cached=3)

    async def healthy(request):
        return web.Response(text="")

    async def go():
        async with serving({("POST", "/generate"): generate, ("GET", "/health"): healthy}) as url:
            overrides = ["trainer.replay.sampling_mask=false", "rollout.samples_per_prompt=2"]
            async with manager_run(tmp_path, model, url, overrides) as run:
                await run.order(Served("1", [url]))
                await run.order(Generate(1))
                first = await run.next_event(GroupDone)
                await run.order(Updating())
                await run.order(Generate(1))
                await asyncio.sleep(1.0)
                held = len(bodies)
                await run.order(Served("2", [url]))
                second = await run.next_event(GroupDone)
            return first, held, second

    first, held, second = asyncio.run(go())
    keys = [body["extra_key"] for body in bodies]
    assert len(bodies) == 2 and held == 1  # nothing was sent between Updating and Served
    assert first.index == 0 and second.index == 1
    assert keys[0].endswith("-v1") and keys[1].endswith("-v2")
    assert keys[1].removesuffix("-v2") == keys[0].removesuffix("-v1")  # one salt for the run's manager


def test_a_loopback_sync_address_is_refused_where_the_engines_are_on_another_host(monkeypatch):
    """Each sender hosts its weight group's rendezvous at the sync address: a loopback one (127.0.1.1, what a hostname
    resolves to on many distributions) where an engine is on another host would leave the first push waiting for
    engines that never connect. Refused at start, naming MOERL_SYNC_ADDRESS; fine where every engine is on this host.
    So is a MOERL_SYNC_ADDRESS that is no address of this host (the rendezvous could not listen there)."""
    from moerl.engines import pool
    from moerl.errors import ConfigError
    from moerl.orchestrator import components as job_module
    from moerl.orchestrator.config import load_config

    monkeypatch.delenv("MOERL_SYNC_ADDRESS", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    local, remote = load_config(None, []), load_config(None, ["engines.urls=[http://10.11.12.13:30000]"])
    assert job_module.sync_address(local) == "127.0.0.1"  # the job's engines, beside this rank
    assert job_module.sync_address(load_config(None, ["engines.urls=[http://localhost:30000]"])) == "127.0.0.1"
    monkeypatch.setattr(pool, "route_address", lambda host="": "127.0.1.1")
    with pytest.raises(
        ConfigError,
        match=r"127\.0\.1\.1, a loopback address \(.* resolves to it\), which the engines on "
        r"10\.11\.12\.13 cannot reach: set MOERL_SYNC_ADDRESS",
    ):
        job_module.sync_address(remote)
    monkeypatch.setenv("GROUP_RANK", "1")  # a second node: the job's engines are on the first, torchrun's MASTER_ADDR
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with pytest.raises(ConfigError, match="engines on 10.0.0.1 cannot reach"):
        job_module.sync_address(local)
    monkeypatch.setenv("MOERL_SYNC_ADDRESS", "127.0.1.1")
    with pytest.raises(ConfigError, match=r"loopback address \(MOERL_SYNC_ADDRESS\)"):
        job_module.sync_address(remote)
    monkeypatch.delenv("GROUP_RANK")  # the first node: its engines beside it reach it there
    assert job_module.sync_address(local) == "127.0.1.1"
    monkeypatch.setenv("MOERL_SYNC_ADDRESS", "198.51.100.77")  # TEST-NET-2: no host's address
    with pytest.raises(ConfigError, match=r"MOERL_SYNC_ADDRESS=198\.51\.100\.77 is not an address of this host"):
        job_module.sync_address(remote)
