"""Agentic groups through the rollout manager, in the test's event loop, against an embedded engine serving a tiny model
warmed up on the calc task's tool format: agent code written for the ``openai`` SDK, agents and tools that fail, and a
weight update in the middle of an episode."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

from moerl.engines.client import EngineClient
from moerl.orchestrator.messages import Dropped, Generate, GroupDone, Served, Updating
from tests.engine_server import serving_app
from tests.episodes import agents
from tests.rollout_manager import manager_run

AGENT_RUN = [
    "task.name=calc",
    "rollout.max_new_tokens=64",
    "rollout.max_episode_tokens=512",
    "rollout.tools=[moerl.tasks.calc:CALC]",
    "trainer.replay.sampling_mask=true",
]


def engine_app(model_dir):
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

    return build_app(EmbeddedEngine(str(model_dir)))


async def serve_version(run, url: str, version: str) -> None:
    """The engine at ``url`` labelled with weight version ``version``, and the manager told so, as a sync leaves
    them."""
    async with EngineClient([url]) as engine:
        await engine.set_weight_version(version)
    await run.order(Served(version, [url]))


def agent_run_events(model, tmp_path, overrides: list[str], groups: int = 1, kinds: tuple = (GroupDone,)) -> list:
    """The first ``groups`` events of ``kinds`` from a rollout manager run of :data:`AGENT_RUN` and ``overrides``, its
    engine an embedded one serving ``model`` as weight version 1."""

    async def go():
        async with serving_app(engine_app(model)) as url:
            async with manager_run(tmp_path, model, url, [*AGENT_RUN, *overrides]) as run:
                await serve_version(run, url, "1")
                await run.order(Generate(groups))
                return [await run.next_event(*kinds) for _ in range(groups)]

    return asyncio.run(go())


def test_agent_code_written_for_the_openai_sdk_is_recorded_token_for_token(calc_model, tmp_path, monkeypatch):
    """The ``openai`` SDK drives each episode's endpoint through a tool exchange. The trained samples' actions are the
    engine's output ids turn by turn; the tool's answer and the template's tokens between turns are context (mask 0,
    version -1, no kept set); each turn asked only for the routing rows it lacked, and the sample's rows are those
    patches end to end, one per fed position."""
    turns: dict[int, list] = {}  # episode -> (input ids, routing start, completion) of each of its engine requests
    generate = EngineClient.generate

    async def recorded(self, input_ids, *args, **kwargs):
        completions = await generate(self, input_ids, *args, **kwargs)
        episode = int(kwargs["rid"].split("-")[1].removeprefix("x"))  # the manager's rid: p{prompt}-x{episode}-...
        turns.setdefault(episode, []).append((list(input_ids), args[1].routing_from, completions[0]))
        return completions

    monkeypatch.setattr(EngineClient, "generate", recorded)

    overrides = ["rollout.agent=tests.episodes.agents:openai_calc_agent", "rollout.samples_per_prompt=8"]
    # the warmed-up model calls the tool about half the time
    (done,) = agent_run_events(calc_model, tmp_path, overrides)
    assert done.episodes is not None and done.episodes["episode/episodes"] == 8
    assert done.episodes["episode/tool_calls"] >= 1 and done.episodes["episode/forks"] == 0
    assert sorted(s.episode for s in done.samples) == list(range(8))
    assert any(len(turns[s.episode]) >= 2 for s in done.samples)  # a tool call, then the answer
    for sample in done.samples:
        mine = turns[sample.episode]
        assert sample.response_ids[sample.actions].tolist() == [i for _, _, c in mine for i in c.output_ids.tolist()]
        context = ~sample.actions
        assert context.any() == (len(mine) > 1)  # the tool's answer and the template between turns
        assert (sample.versions[context] == -1).all() and (sample.behaviour_logprobs[context] == 0).all()
        assert (np.diff(sample.mask_offsets)[context] == 0).all()
        # Each turn asked from where the rows so far ended: the stream it extended, less the last token.
        patches = [c.routing for _, _, c in mine]
        assert [start for _, start, _ in mine] == [0, *np.cumsum([len(p) for p in patches])[:-1].tolist()]
        assert sample.routing_starts.tolist() == [start for _, start, _ in mine]  # what check-replay reads
        for (ids, _, c), (_, start, _) in itertools.pairwise(mine):
            assert start == len(ids) + len(c.output_ids) - 1
        assert sample.fed_len == sum(len(p) for p in patches)  # nothing after the last action: its rows all count
        assert (sample.routing == np.concatenate(patches)).all()


def test_failing_agents_and_tools_fail_their_episodes_and_the_run_goes_on(calc_model, tmp_path):
    """An agent that raises and one past rollout.episode_timeout_s end their episodes, counted by reason; a tool that
    raises and one past its timeout answer the model with the error and the episode goes on; a group whose every
    episode failed is dropped as episode_failure; the next group is generated as if nothing happened."""

    overrides = [
        "rollout.agent=tests.episodes.agents:failing_agent",
        "rollout.tools=[tests.episodes.agents:BROKEN,tests.episodes.agents:HANGING]",
        "rollout.samples_per_prompt=6",
        "rollout.episode_timeout_s=10",  # room for two CPU turns and a tool timeout: only episode 1 outlives it
        "task.shuffle=false",
    ]
    events = sorted(agent_run_events(calc_model, tmp_path, overrides, 3, (GroupDone, Dropped)), key=lambda e: e.index)
    first, dropped, third = events
    assert isinstance(dropped, Dropped) and dropped.index == 1 and dropped.reason == "episode_failure"
    assert isinstance(first, GroupDone) and isinstance(third, GroupDone)
    counts = first.episodes
    assert counts is not None and counts["episode/failed_agent_error"] == 1 and counts["episode/failed_timeout"] == 1
    assert counts["episode/tool_failures"] == 2
    assert sorted(s.episode for s in first.samples) == [2, 3, 4, 5]
    # the tools' errors were fed to the model as context, and the episodes went on to a second turn
    assert all((~s.actions).any() for s in first.samples if s.episode in (2, 3))
    assert [s.reward for s in sorted(first.samples, key=lambda s: s.episode)] == [1.0, 1.0, 0.0, 0.0]


def test_an_update_between_turns_gives_each_turn_the_version_that_made_it(calc_model, tmp_path):
    """Weights updated while the episodes wait between turns: the first turn's tokens keep version 1, the second's
    carry version 2, the context between them none; the group's staleness counts its oldest model token. The second
    turn is keyed to the new version's prefix cache, so the prefix the first computed is computed again under the new
    weights: its positions are counted, and their rows stay the first turn's."""
    from moerl.orchestrator.rollouts import Group

    agents.FIRST_TURNS_DONE.clear()

    async def go():
        agents.SECOND_TURN_MAY_START = asyncio.Event()
        async with serving_app(engine_app(calc_model)) as url:
            overrides = [
                *AGENT_RUN,
                "rollout.agent=tests.episodes.agents:two_turn_agent",
                "rollout.samples_per_prompt=2",
            ]
            async with manager_run(tmp_path, calc_model, url, overrides) as run:
                await serve_version(run, url, "1")
                await run.order(Generate(1))
                while len(agents.FIRST_TURNS_DONE) < 2:
                    await asyncio.sleep(0.02)
                await run.order(Updating())
                await serve_version(run, url, "2")
                agents.SECOND_TURN_MAY_START.set()
                return await run.next_event(GroupDone)

    done = asyncio.run(go())
    assert len(done.samples) == 2 and done.retries == 0
    for sample in done.samples:
        versions = sample.versions
        (first_end,) = np.flatnonzero(np.diff(sample.actions.astype(int)) == -1)[:1] + 1
        assert (versions[:first_end] == 1).all() and (versions[~sample.actions] == -1).all()
        assert (versions[first_end:][sample.actions[first_end:]] == 2).all()
    assert Group(done.index, done.samples).oldest_version() == 1
    assert done.episodes is not None and done.episodes["routing/recomputed_positions"] > 0


def test_under_retry_an_update_regenerates_only_the_turn_it_interrupted(calc_model, tmp_path, monkeypatch):
    """rollout.partial=retry: a turn an update aborted is asked for again (a new seed, the new weights); the episode's
    finished turns are not: its samples hold the first turn as first generated and the second turn's new answer."""
    import dataclasses

    requests: list[tuple[str, int]] = []
    aborted: set[str] = set()  # the episodes whose second turn an update aborted
    generate = EngineClient.generate

    async def second_turns_aborted_once(self, input_ids, *args, **kwargs):
        (completion,) = await generate(self, input_ids, *args, **kwargs)
        rid, start = kwargs["rid"], args[1].routing_from
        requests.append((rid, start))
        episode = rid.split("-l")[0]  # the manager's rid: p{prompt}-x{episode}-l{input length}-...
        if start and episode not in aborted:  # the weight update's abort, as the engine answers it
            aborted.add(episode)
            completion = dataclasses.replace(completion, finish_reason={"type": "abort"})
        return [completion]

    monkeypatch.setattr(EngineClient, "generate", second_turns_aborted_once)
    first_turns: dict[int, list[int]] = {}
    episode_generate = agents.Episode.generate

    async def first_turn_kept(self, new_ids=(), **overrides):
        out = await episode_generate(self, new_ids, **overrides)
        first_turns.setdefault(self.index, out)
        return out

    monkeypatch.setattr(agents.Episode, "generate", first_turn_kept)
    agents.FIRST_TURNS_DONE.clear()

    async def go():
        agents.SECOND_TURN_MAY_START = asyncio.Event()
        agents.SECOND_TURN_MAY_START.set()
        async with serving_app(engine_app(calc_model)) as url:
            overrides = [
                *AGENT_RUN,
                "rollout.agent=tests.episodes.agents:two_turn_agent",
                "rollout.samples_per_prompt=2",
                "rollout.partial=retry",
            ]
            async with manager_run(tmp_path, calc_model, url, overrides) as run:
                await serve_version(run, url, "1")
                await run.order(Generate(1))
                return await run.next_event(GroupDone)

    done = asyncio.run(go())
    assert done.retries == 2  # one per episode: its second turn, once
    assert [start for _, start in requests].count(0) == 2  # each first turn was generated once
    for sample in done.samples:
        assert sample.response_ids[: len(first_turns[sample.episode])].tolist() == first_turns[sample.episode]
        assert sample.finish_reason != "abort"


def test_a_groups_turns_go_to_the_replica_its_key_hashes_to(calc_model, tmp_path, monkeypatch):
    """Episodes of one group run on one replica, turn after turn, so every turn finds the group's prompt in that
    replica's prefix cache; other groups spread over the replicas by their keys."""
    replicas: dict[str, set[str]] = {}  # prompt -> the replicas its requests went to
    generate_on = EngineClient.generate_on

    async def recorded(self, url, request, routing_start):
        replicas.setdefault(request.rid.split("-")[0], set()).add(url)
        return await generate_on(self, url, request, routing_start)

    monkeypatch.setattr(EngineClient, "generate_on", recorded)

    async def go():
        async with serving_app(engine_app(calc_model)) as a, serving_app(engine_app(calc_model)) as b:
            overrides = [*AGENT_RUN, "rollout.agent=tool_agent", "rollout.samples_per_prompt=4"]
            async with manager_run(tmp_path, calc_model, [a, b], overrides) as run:
                for url in (a, b):
                    async with EngineClient([url]) as engine:
                        await engine.set_weight_version("1")
                await run.order(Served("1", [a, b]))
                await run.order(Generate(6))
                return [await run.next_event(GroupDone) for _ in range(6)], {a, b}

    done, urls = asyncio.run(go())
    assert sum(d.episodes["episode/turns"] for d in done if d.episodes) > 6 * 4  # groups of several turns
    assert all(len(used) == 1 for used in replicas.values()), replicas
    assert set().union(*replicas.values()) == urls  # six groups' keys reached both


@pytest.mark.parametrize("agent", ["engines_gone_agent", "grouped_engines_gone_agent", "endpoint_engines_gone_agent"])
def test_engines_gone_in_an_agents_turn_stop_the_run_not_the_episode(calc_model, tmp_path, monkeypatch, agent):
    """No healthy engine for engines.down_timeout_s is the run's end (checkpoint and stop), wherever it surfaces: an
    agent's turn passes it on rather than failing one episode, whether the agent raises it bare, inside its own task
    groups beside other failures, or meets it as its endpoint's 500 (the episode's turn found no engine)."""
    from moerl.errors import EnginesDown
    from moerl.orchestrator.messages import RolloutFailed

    async def no_engine(*args, **kwargs):
        raise EnginesDown("no engine replica has been healthy")

    monkeypatch.setattr(agents.Episode, "chat_turn", no_engine)

    overrides = [f"rollout.agent=tests.episodes.agents:{agent}"]
    (event,) = agent_run_events(calc_model, tmp_path, overrides, kinds=(RolloutFailed, GroupDone, Dropped))
    assert type(event).__name__ == "RolloutFailed" and event.engines_down, event


def test_an_agent_that_fails_after_its_budget_is_spent_loses_no_sample(calc_model, tmp_path):
    """Every episode spends its token budget, then its agent raises: each is scored as it stands (truncated), none is
    dropped, and the endings are counted."""

    overrides = ["rollout.agent=tests.episodes.agents:spends_budget_then_raises_agent", "rollout.samples_per_prompt=3"]
    (done,) = agent_run_events(calc_model, tmp_path, overrides)
    assert sorted(s.episode for s in done.samples) == [0, 1, 2]
    assert all(s.finish_reason == "length" for s in done.samples)
    assert done.episodes["episode/truncated"] == done.episodes["episode/truncated_agent_failed"] == 3
    assert not any(k.startswith("episode/failed_") for k in done.episodes)


def test_the_rollout_managers_log_keeps_moerls_lines_and_not_an_agent_clients_requests():
    import logging

    from moerl.cli.rollout_manager import configure_logging

    before = logging.getLogger().level, logging.getLogger("moerl").level
    try:
        logging.getLogger().setLevel(logging.INFO)
        configure_logging()
        assert logging.getLogger("moerl.episodes.endpoint").isEnabledFor(logging.INFO)
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)  # the openai SDK's per-request lines
        assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
    finally:
        logging.getLogger().setLevel(before[0])
        logging.getLogger("moerl").setLevel(before[1])
