"""Engines fail, prompts are not lost: the real rollout manager against embedded engines that are killed,
hung and lost for good, the trainer side's rollout buffer counting every prompt."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import zmq

from moerl.engines.client import EngineClient
from moerl.engines.pool import EnginePool, EnginePoolConfig
from moerl.env import group_left
from moerl.errors import EnginesDown
from moerl.models.tiny import tiny_tokenizer
from moerl.orchestrator.components import brief_manager, start_manager
from moerl.orchestrator.config import load_config, to_yaml
from moerl.orchestrator.rollouts import RolloutBuffer

GROUPS = 8


@contextmanager
def rollouts(model: Path, run_dir: Path, replicas: int, *overrides: str):
    """``replicas`` embedded engines, the rollout manager on them, and the buffer it reports to (sync mode)."""
    stops = ",".join(str(tiny_tokenizer().convert_tokens_to_ids(c)) for c in "eat ")
    cfg = load_config(
        None,
        [
            f"model.path={model}",
            "run.mode=sync",
            "rollout.samples_per_prompt=2",
            "rollout.max_new_tokens=48",
            f"rollout.stop_token_ids=[{stops}]",
            "engines.health_interval_s=0.2",
            "engines.health_failures=2",
            *overrides,
        ],
    )
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))
    pool = EnginePool(
        EnginePoolConfig(
            model_path=str(model),
            server="embedded",
            replicas=replicas,
            base_port=0,
            dtype="float32",
            log_dir=str(run_dir / "logs"),
        )
    )
    ctx = zmq.Context()
    buffer = RolloutBuffer(ctx, cfg.rollout, "sync")
    manager = None
    try:
        urls = pool.start()
        asyncio.run(serve_version_0(urls))
        manager = start_manager(run_dir)
        brief_manager(run_dir / "config.yaml", model, urls, buffer, 0, [], run_dir)
        yield pool, buffer
    finally:
        if manager is not None:
            buffer.stop(timeout_s=10)
            manager.wait(timeout=30)
        buffer.close()
        pool.stop()
        ctx.term()


async def serve_version_0(urls: list[str]) -> None:
    """What the job's first sync does: the engines' weights are policy version 0."""
    async with EngineClient(urls) as client:
        await client.set_weight_version("0")


def take(buffer: RolloutBuffer, groups: int) -> list:
    """``groups`` finished groups (sync mode orders them)."""
    return [group for instalment in buffer.instalments(0, groups, whole=False) for group in instalment]


def signal_replica(pool: EnginePool, replica: int, sig: int) -> None:
    os.killpg(pool.procs[replica].pid, sig)


def wait_for(predicate, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


@pytest.mark.e2e
def test_prompts_on_a_killed_or_hung_replica_are_reissued_and_every_prompt_is_accounted(model, tmp_path):
    with rollouts(model, tmp_path / "run", 2, "engines.request_timeout_s=10") as (pool, buffer):
        url0, url1 = pool.urls
        # Hung (SIGSTOP): the requests it is given pass their deadline and go to the other replica; it is probed dead,
        # and comes back when continued.
        signal_replica(pool, 1, signal.SIGSTOP)
        got = take(buffer, GROUPS)
        assert buffer.engines[url1] in ("suspect", "dead")
        hung_retries = buffer.take_reissues()["engine_failure"]
        signal_replica(pool, 1, signal.SIGCONT)
        wait_for(lambda: (buffer.drain(), set(buffer.engines.values()) == {"healthy"})[1])
        # Killed (SIGKILL) as the prompts are issued: what it was given (in flight, or refused if not yet sent) goes to
        # the replica that is left; either way it gets some, being healthy until one of its requests fails.
        kill = threading.Timer(0.05, signal_replica, (pool, 1, signal.SIGKILL))
        kill.start()
        got += take(buffer, GROUPS)
        kill.join()
        wait_for(lambda: (buffer.drain(), buffer.engines[url1] == "dead")[1])
        killed_retries = buffer.take_reissues()["engine_failure"]
        acct = buffer.acct
        assert len({g.index for g in got}) == 2 * GROUPS == acct.issued  # every prompt came back, none twice
        assert hung_retries > 0 and killed_retries > 0  # both failures caught prompts in flight
        assert sum(g.engine_retries for g in got) == hung_retries + killed_retries
        assert not acct.dropped and acct.balanced()
        for group in got:
            assert len(group.samples) == 2 and all(s.response_len > 0 for s in group.samples)


@pytest.mark.e2e
def test_with_every_engine_gone_prompts_past_their_budget_are_dropped_and_the_run_stops_with_one_error(model, tmp_path):
    with rollouts(model, tmp_path / "run", 1, "rollout.engine_retries=0", "engines.down_timeout_s=2") as (pool, buffer):
        signal_replica(pool, 0, signal.SIGKILL)
        with pytest.raises(EnginesDown, match="no engine replica has been healthy for engines.down_timeout_s=2"):
            take(buffer, GROUPS)
        acct = buffer.acct
        assert acct.dropped["engine_failure"] > 0 and acct.balanced()


@pytest.mark.e2e
def test_an_update_that_finds_every_engine_dead_has_them_started_again_while_it_waits(model, tmp_path):
    """Every replica killed between the step's restarts and its sync: the sync waits for one to answer, and the job
    starts them again meanwhile; nothing else would, and the run would stop after engines.down_timeout_s."""
    from moerl.weight_sync.disk import DiskSync

    with EnginePool(
        EnginePoolConfig(
            model_path=str(model), server="embedded", base_port=0, dtype="float32", log_dir=str(tmp_path / "logs")
        )
    ) as pool:
        sync = DiskSync(pool.urls, tmp_path / "sync", model)
        try:
            signal_replica(pool, 0, signal.SIGKILL)
            pool.procs[0].wait()
            sync.down_timeout_s = 2
            with pytest.raises(EnginesDown, match="no engine answered /health for 2 s"):
                sync.choose_engines()
            sync.down_timeout_s = 120
            sync.while_down = lambda: pool.revive(max_restarts=1)
            assert sync.choose_engines() == pool.urls and pool.restarts == {0: 1}
        finally:
            sync.close()


def test_a_replica_failing_now_and_then_is_always_restarted_and_a_crash_loop_is_given_up_on(tmp_path, monkeypatch):
    """engines.max_restarts counts restarts within engines.restart_window_s: a replica that dies once a day is
    restarted on a week-long run's eighth day as on its first; one that dies every 10 s is given up on after
    max_restarts."""
    from moerl.engines import pool as pool_module

    class Exited:
        pid, returncode = 0, 1

        def poll(self):
            return 1

    clock = [0.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(pool_module, "group_left", lambda pgid: [])
    monkeypatch.setattr(pool_module.os, "killpg", lambda *args: None)

    def restarts(every_s: float) -> tuple[int, set[int]]:
        pool = EnginePool(EnginePoolConfig(model_path=str(tmp_path), server="embedded", base_port=0))
        pool.ports, pool.procs = [1], [Exited()]
        monkeypatch.setattr(pool, "_spawn_replica", lambda i, port, restart=False: Exited())
        done = 0
        for _ in range(8):
            done += len(pool.revive(max_restarts=3, window_s=3600.0))
            clock[0] += every_s
        return done, pool.given_up

    assert restarts(every_s=86400.0) == (8, set())
    assert restarts(every_s=10.0) == (3, {0})


@pytest.mark.e2e
def test_a_dead_replica_is_started_again_only_once_every_process_of_its_server_has_ended(tmp_path, monkeypatch, caplog):
    """A GPU's memory is free once every process that held it has ended: a server started earlier fails for want of
    it, which costs one of the replica's restarts. revive() kills what is left, says what it waits for, and starts the
    replica at a later call."""
    from moerl.engines import pool as pool_module

    # A server that has exited and left a worker in its process group, as SGLang's scheduler processes may.
    server = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    worker = int(server.stdout.readline())
    server.wait()
    pool = EnginePool(EnginePoolConfig(model_path=str(tmp_path), server="embedded", base_port=0))
    pool.ports, pool.procs = [1], [server]
    started = []
    monkeypatch.setattr(pool, "_spawn_replica", lambda i, port, restart=False: started.append((i, restart)) or server)
    lingering = [True]  # a member still ending (in a driver call, say) after the SIGKILL
    monkeypatch.setattr(pool_module, "group_left", lambda pgid: [worker] if lingering[0] else group_left(pgid))
    with caplog.at_level("WARNING", logger="moerl.engines"):
        assert pool.revive(max_restarts=2) == [] and pool.revive(max_restarts=2) == []
    assert started == [] and pool.restarts == {}
    assert [r.getMessage() for r in caplog.records if "still running" in r.getMessage()] == [
        f"engine 0 (port 1) exited with 0; processes of its server still running (pids [{worker}]) after SIGKILL, "
        "for 0 s: it is started again once they have ended"
    ]  # once, not at each call
    deadline = time.monotonic() + 30
    while group_left(server.pid):  # the worker, SIGKILLed by revive(), ends
        assert time.monotonic() < deadline, f"worker {worker} outlived its SIGKILL"
        time.sleep(0.05)
    lingering[0] = False
    assert pool.revive(max_restarts=2) == pool.replica_urls and started == [(0, True)] and pool.restarts == {0: 1}


def test_replica_health_states_follow_failures_probes_and_versions():
    from moerl.engines.health import ReplicaHealth, State

    health = ReplicaHealth(["a", "b"], failures_to_dead=2)
    health.sync_reached("3", ["a", "b"])
    health.request_failed("a", "connection refused")
    assert health.usable() == ["b"] and health.state("a") is State.SUSPECT
    health.probed("a", True, "3")  # a blip: it answers and serves the policy
    assert health.state("a") is State.HEALTHY
    health.request_failed("a", "deadline")
    health.probed("a", False, None)
    assert health.state("a") is State.SUSPECT  # one failed probe is not enough
    health.probed("a", False, None)
    assert health.state("a") is State.DEAD
    health.restarted("a")
    health.probed("a", False, None)
    assert health.state("a") is State.RESTARTING  # still starting
    health.probed("a", True, "default")
    assert health.state("a") is State.STALE and health.usable() == ["b"]  # up, but not holding the policy
    health.sync_reached("4", ["b"])
    health.probed("a", True, "4")
    assert health.state("a") is State.STALE  # the version matches, but that sync did not reach it
    health.sync_reached("4", ["a", "b"])
    health.probed("a", True, "4")
    assert health.state("a") is State.HEALTHY and health.usable() == ["a", "b"]
    health.sync_reached("5", ["a"])
    assert health.state("b") is State.STALE and health.usable() == ["a"]  # healthy, but the sync missed it

    # A LoRA run's engines keep their base weight version: a restarted replica reports what the others do, but it lost
    # the adapters every sync loaded; it is back only once a sync reaches it.
    lora = ReplicaHealth(["a", "b"])
    lora.sync_reached(None, ["a", "b"])
    lora.restarted("a")
    lora.probed("a", True, "default")
    assert lora.state("a") is State.STALE and lora.usable() == ["b"]
    lora.sync_reached(None, ["a"])
    lora.probed("a", True, "default")
    assert lora.state("a") is State.HEALTHY

    # A request finds a replica without the policy (restarted unseen): stale until a sync reaches it, unless one
    # already has since the request chose it (the answer describes the replica before that sync).
    sent = lora.epochs["a"]
    lora.sync_reached(None, ["a", "b"])
    lora.lost_policy("a", "refused the adapter", sent)
    assert lora.state("a") is State.HEALTHY
    lora.lost_policy("a", "refused the adapter", lora.epochs["a"])
    assert lora.state("a") is State.STALE and lora.synced == {"b"}

    # A catch-up of full weights brings a replica the policy the others still serve: they stay in rotation.
    full = ReplicaHealth(["a", "b"])
    full.sync_reached("4", ["a", "b"])
    before = full.epochs["a"]
    full.restarted("a")
    assert full.epochs["a"] > before  # what a request sent before the restart reads is not the restarted replica
    full.sync_reached("4", ["a"], also=True)
    full.probed("a", True, "4")
    assert full.usable() == ["a", "b"] and full.synced == {"a", "b"}
    # One the syncs reached that answers under another version has lost the policy unseen (given by URL, restarted).
    full.request_failed("b", "connection refused")
    lost = full.losses["b"]
    full.probed("b", True, "default")
    assert full.state("b") is State.STALE and full.synced == {"a"} and full.losses["b"] == lost + 1


def test_the_trainer_learns_every_replica_that_lost_its_policy_between_two_reads():
    """The replicas a catch-up sync must reach again: each whose count of losses (restarted, dead, found serving
    something else) rose in any report since the last read, whatever its state shows (a restart passes through
    several, and a replica already stale can lose its policy again without changing state)."""
    from moerl.engines.health import State
    from moerl.orchestrator.config import RolloutSection
    from moerl.orchestrator.messages import EnginesChanged

    buffer = RolloutBuffer(zmq.Context.instance(), RolloutSection(), "async")
    try:
        buffer._handle(EnginesChanged({"a": State.HEALTHY, "b": State.STALE}, {"a": 0, "b": 0}))
        for states, losses in (
            ({"a": State.RESTARTING, "b": State.STALE}, {"a": 1, "b": 0}),
            ({"a": State.HEALTHY, "b": State.STALE}, {"a": 1, "b": 0}),
        ):
            buffer._handle(EnginesChanged(states, losses))
        assert buffer.take_left() == {"a"} and buffer.take_left() == set()  # though the last report shows it healthy
        # restarted unseen, stale again
        buffer._handle(EnginesChanged({"a": State.HEALTHY, "b": State.STALE}, {"a": 1, "b": 1}))
        buffer._handle(EnginesChanged({"a": State.HEALTHY, "b": State.STALE}, {"a": 1, "b": 1}))
        assert buffer.take_left() == {"b"}
    finally:
        buffer.close()


def test_a_sync_changes_the_rotation_and_the_adapter_before_any_request_can_read_them():
    """The rollout manager applies a sync's ``Served`` order at once: at its first await (where a waiting request
    could pick a replica and an adapter), a replica a catch-up brought back is in rotation only under the adapter
    the catch-up loaded there, and one the sync passed over is already out of rotation."""
    from moerl.engines.client import EngineClient
    from moerl.engines.health import ReplicaHealth, State
    from moerl.orchestrator.adapters import Adapters
    from moerl.orchestrator.manager import RolloutManager
    from moerl.orchestrator.messages import Served

    seen, unloaded = [], []

    class Client(EngineClient):
        def __init__(self):  # the probing and unloading alone: no sessions or workers
            self.health = ReplicaHealth(["a", "b"])

        async def probe(self, url):
            seen.append((manager.adapters.current, manager.client.health.usable()))
            await asyncio.sleep(0)
            return True, "default"

        async def unload_lora(self, name):
            unloaded.append(name)

    async def report():
        seen.append((manager.adapters.current, manager.client.health.usable()))

    manager = RolloutManager.__new__(RolloutManager)  # the order handling alone: no engines, tokenizer or sockets
    manager.client, manager._report = Client(), report
    manager.adapters = Adapters(manager.client)
    manager.adapters.current = ("v2", 2)
    health = manager.client.health
    health.sync_reached(None, ["a", "b"])

    # Both replicas die and are started again; "a" answers first, and the catch-up reloads policy 2 on it alone
    # under a name of its own (an engine that only hung still holds the first).
    health.restarted("a"), health.restarted("b")
    asyncio.run(manager._served(Served(None, ["a"], "v2.1", 2)))
    assert seen[0] == (("v2.1", 2), []) and seen[-1] == (("v2.1", 2), ["a"])
    assert unloaded == ["v2"] and health.state("b") is State.RESTARTING

    # "b" is back and caught up; the next sync reaches "a" only: "b" leaves rotation before the new adapter is named.
    health.sync_reached(None, ["a", "b"]), health.probed("b", True, "default")
    seen.clear()
    asyncio.run(manager._served(Served(None, ["a"], "v3", 3)))
    assert seen == [(("v3", 3), ["a"])] and health.state("b") is State.STALE and unloaded == ["v2", "v2.1"]


def test_a_retired_adapter_is_unloaded_once_the_last_request_using_it_fails_and_is_asked_again():
    """A sync names a new adapter while a request still uses the old one; that request's replica fails, and it is asked
    again under the new one. The old adapter, which no request uses any more, is unloaded then, not at a later
    request's end."""
    from types import SimpleNamespace

    from moerl.engines.client import ReplicaDown
    from moerl.orchestrator.adapters import Adapters
    from moerl.orchestrator.generation import Generation, Tries

    unloaded: list[str] = []
    used: list[str | None] = []

    class Client:
        urls = ["a", "b"]
        health = SimpleNamespace(served="1")

        async def until_usable(self, *args) -> None:
            pass

        async def generate(self, ids, params, returns, *, lora_path=None, **kwargs):
            used.append(lora_path)
            if len(used) == 1:  # a sync names v2 while this request runs on v1, then its replica fails
                adapters.serve("v2", 2)
                raise ReplicaDown("a", "connection reset")
            return [SimpleNamespace(finish_reason={"type": "stop"})]

        async def unload_lora(self, name: str) -> None:
            unloaded.append(name)

    async def report() -> None:
        pass

    cfg = load_config(None, ["lora.enabled=true"])
    client = Client()
    adapters = Adapters(client)
    adapters.serve("v1", 1)
    generation = Generation(cfg, client, adapters, asyncio.Event(), report, "salt", [])
    generation.serving.set()
    completions, version = asyncio.run(generation(0, [1, 2, 3], Tries(), generation.params(0, 1)))
    assert used == ["v1", "v2"] and version == 2 and len(completions) == 1
    assert unloaded == ["v1"] and adapters.users == {"v1": 0, "v2": 0}


def test_a_probe_answer_that_predates_a_sync_does_not_undo_it():
    """The manager's probe of a restarted replica is still waiting when a catch-up sync reaches it and the sync's own
    probe brings it back; the late answer (what it held before the sync) must not make it stale again."""
    from moerl.engines.client import EngineClient
    from moerl.engines.health import ReplicaHealth, State

    class Client(EngineClient):
        def __init__(self):  # the probing alone: no sessions or workers
            self.health, self.answers = ReplicaHealth(["a"]), []

        async def probe(self, url):
            version, hold = self.answers.pop(0)
            if hold is not None:
                await hold.wait()
            return True, version

    async def go():
        client = Client()
        health = client.health
        health.sync_reached("5", ["a"])
        health.restarted("a")
        release = asyncio.Event()
        client.answers = [("default", release), ("5", None)]
        late = asyncio.create_task(client.probe_out_of_rotation())  # the watch's probe, waiting on the restarted one
        await asyncio.sleep(0)
        health.sync_reached("5", ["a"])  # the catch-up reaches it, and its own probe brings it back
        await client.probe_out_of_rotation(["a"])
        assert health.state("a") is State.HEALTHY
        release.set()
        await late
        assert health.state("a") is State.HEALTHY

    asyncio.run(go())


def test_a_paused_replica_holds_the_groups_in_flight_past_the_down_timeout_and_serves_them_after(model, tmp_path):
    """Colocated, the trainer pauses the engines for its phase, however long, while the groups of rollout.oversample its
    step did not need are still generating (the manager is not told). Their requests time out, and /health fails while
    paused (as SGLang's does), yet the replica answers /model_info: it is paused, not down, so a group waits past
    engines.down_timeout_s (it does not stop the run) and is generated once the sync after the trainer's phase serves
    the new policy."""
    import json

    from aiohttp import web

    from moerl.orchestrator.messages import Generate, GroupDone, Served, Updating
    from tests.engine_server import serving, two_token_answer
    from tests.rollout_manager import manager_run

    config = json.loads((model / "config.json").read_text())
    layers, topk = config["num_hidden_layers"], config["num_experts_per_tok"]
    served = {"version": "1", "paused": False}
    arrived, generating = asyncio.Event(), asyncio.Event()

    async def generate(request):
        body = await request.json()
        arrived.set()
        await generating.wait()  # the trainer pauses the replica while this is in flight
        return two_token_answer(body, served["version"], layers, topk)

    async def health(request):
        return web.Response(status=503 if served["paused"] else 200)

    async def model_info(request):
        return web.json_response({"weight_version": served["version"]})

    async def go():
        routes = {("POST", "/generate"): generate, ("GET", "/health"): health, ("GET", "/model_info"): model_info}
        async with serving(routes) as url:
            overrides = [
                "trainer.replay.sampling_mask=false",
                "rollout.samples_per_prompt=2",
                "engines.request_timeout_s=0.5",
                "engines.down_timeout_s=1",
                "engines.health_interval_s=0.2",
                "engines.health_failures=2",
            ]
            async with manager_run(tmp_path, model, url, overrides) as run:
                try:
                    await run.order(Served("1", [url]))
                    await run.order(Generate(1))
                    await arrived.wait()
                    served["paused"] = True  # the trainer's phase begins
                    waiting = asyncio.create_task(run.next_event(GroupDone))
                    await asyncio.sleep(3.0)  # three down timeouts
                    assert not waiting.done(), waiting.result()  # a RolloutFailed (engines down) fails it
                    # the sync after the trainer's phase: the replica generates again, under the new policy
                    await run.order(Updating())
                    served.update(version="2", paused=False)
                    generating.set()
                    await run.order(Served("2", [url]))
                    return await waiting
                finally:
                    generating.set()  # else the server's shutdown waits on the requests it holds

    done = asyncio.run(go())
    assert done.index == 0 and done.engine_retries >= 1  # its request timed out, and waited for the replica
    assert [s.versions.tolist() for s in done.samples] == [[2, 2], [2, 2]]


def test_every_replica_answering_the_same_error_stops_the_run_and_one_answering_it_alone_does_not(model, tmp_path):
    """SGLang answered every request of a run with the same 500 (a feature it could not serve): each looked like a
    replica's failure, re-issued, the replica back at its next /health, each prompt dropped after its retries replaced
    by the next. While another replica serves, the failing one's prompts are re-issued there; once every replica
    answers the same error, a prompt's retries on each of them in a row, the run stops, naming the error."""
    import json

    from aiohttp import web

    from moerl.orchestrator.messages import Generate, GroupDone, RolloutFailed, Served
    from tests.engine_server import serving, two_token_answer

    config = json.loads((model / "config.json").read_text())
    layers, topk = config["num_hidden_layers"], config["num_experts_per_tok"]
    error = "The sampling backend did not return captured sampling support."
    failing = {"a": True, "b": False}
    answered = {"a": 0, "b": 0}

    def replica(name: str):
        async def generate(request):
            body = await request.json()
            answered[name] += 1
            if failing[name]:
                return web.json_response({"object": "error", "message": error, "code": 500}, status=500)
            return two_token_answer(body, "1", layers, topk)

        async def health(request):
            return web.Response(text="")

        async def model_info(request):
            return web.json_response({"weight_version": "1"})

        return {("POST", "/generate"): generate, ("GET", "/health"): health, ("GET", "/model_info"): model_info}

    async def go():
        async with serving(replica("a")) as a, serving(replica("b")) as b:
            overrides = [
                "trainer.replay.sampling_mask=false",
                "rollout.samples_per_prompt=2",
                "rollout.engine_retries=2",
                "engines.health_interval_s=0.1",
            ]
            async with manager_run(tmp_path, model, [a, b], overrides) as run:
                await run.order(Served("1", [a, b]))
                await run.order(Generate(6))
                done = [await run.next_event(GroupDone) for _ in range(6)]  # a's failures re-issued on b
                assert answered["a"] > 0 and all(g.samples for g in done)
                failing["b"] = True
                before = sum(answered.values())
                # Two prompts: one is dropped after its retries, the other's last failure is the bound's.
                await run.order(Generate(2))
                failed = await asyncio.wait_for(run.next_event(RolloutFailed), 60)  # without the bound: never
                return failed, sum(answered.values()) - before

    from tests.rollout_manager import manager_run

    failed, requests = asyncio.run(go())
    assert failed.engines_down and error in failed.message and "every engine answers" in failed.message
    assert requests == (2 + 1) * 2  # a prompt's retries on each replica
