"""The rollout manager: its own process, asyncio, keeping the engines full.

It takes orders from the trainer ("generate N more groups", "use this adapter", "stop"; the types are in
:mod:`moerl.orchestrator.messages`) over one ZMQ socket and streams
events back over another: a prompt issued, a finished group (its samples carry per-token policy
versions, routing and kept sets, and rewards), or an error. Groups are sent the moment they are
scored, in finishing order, so the trainer is never gated by the slowest response of a batch.

Engines fail: a prompt whose replica fails (transport error, 5xx, past ``engines.request_timeout_s``) is
re-issued to another healthy replica with the same seed, up to ``rollout.engine_retries`` times, then
dropped as ``engine_failure``; the trainer's accounting counts both. Replicas out of rotation are probed
every ``engines.health_interval_s`` and come back once they answer and report the weight version the
trainer last served; with none healthy for ``engines.down_timeout_s`` the run stops with one error, and so it does
when every replica answers every request with the same server error (:class:`~moerl.engines.health.SameAnswer`). A
replica the trainer has paused (colocated, while it trains: the surplus groups of ``rollout.oversample`` are still
generating then) is not down, however long the pause.

This module is the order loop, the health watch and the reports; a group's path (generated, scored, filtered) is
:mod:`~moerl.orchestrator.groups`, its engine requests :mod:`~moerl.orchestrator.generation`, a LoRA run's adapters
:mod:`~moerl.orchestrator.adapters`. The process starts as ``python -m moerl.cli.rollout_manager``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from moerl.engines.client import EngineClient
from moerl.engines.generation_workers import GenerationWorkers
from moerl.episodes.agents import SIMULATED, Agent, load_agent, load_tools, simulated_agent
from moerl.episodes.endpoint import EpisodeEndpoint
from moerl.models import model_shape
from moerl.orchestrator.adapters import Adapters
from moerl.orchestrator.config import EngineSection, RunConfig, request_timeout_real_s
from moerl.orchestrator.generation import Generation
from moerl.orchestrator.groups import AgentEpisodes, GroupAgent, GroupRunner, SampleRequests, SingleTurn
from moerl.orchestrator.messages import (
    ORDERS,
    EnginesChanged,
    Generate,
    Issued,
    ManagerSpec,
    Restarting,
    Served,
    ServedModel,
    Stopped,
    Updating,
    checked,
    send_event,
)
from moerl.orchestrator.scheduling import Dispatcher, GroupLengths
from moerl.rewards import Rewarder
from moerl.rewards.combine import COMBINATIONS, Combination
from moerl.rewards.judge import Judge, Judging
from moerl.rewards.model import Classifier, Replicas, RewardModel
from moerl.rewards.process import ProcessRewardModel, ProcessRewards, StepCutter
from moerl.rewards.teacher import Teacher
from moerl.simulation import Profile
from moerl.tasks import PromptStream
from moerl.tasks.filters import load_filter

log = logging.getLogger("moerl.rollout")


def replicas_of(e: EngineSection, urls: list[str]) -> Replicas:
    """A scorer's replicas at ``urls``, outlasting failures as its section ``e`` says."""
    return Replicas(
        urls,
        timeout_s=e.request_timeout_s or 600.0,
        down_timeout_s=e.down_timeout_s,
        health_interval_s=e.health_interval_s,
        failures_to_dead=e.health_failures,
    )


def reward_model(cfg: RunConfig, served: ServedModel | None) -> tuple[RewardModel | None, Combination | None]:
    """The run's reward model on its engines (``served``), and how its score combines with the task's reward (None,
    None without one)."""
    w = cfg.reward
    if served is None:
        return None, None
    replicas = replicas_of(w.engines, served.urls)
    model = (
        Judge(served.model, replicas, Judging(w.judge_prompt, w.verdict, w.judge_max_new_tokens))
        if w.kind == "generative"
        else Classifier(served.model, replicas)
    )
    return model, COMBINATIONS.load(w.combine)


def teacher(cfg: RunConfig, served: ServedModel | None, workers: GenerationWorkers | None) -> Teacher | None:
    """The run's teacher on its engines (``served``; None without one), its large answers carried by ``workers`` (the
    policy client's)."""
    if served is None:
        return None
    distill = cfg.trainer.loss.distill
    return Teacher(
        replicas_of(cfg.teacher.engines, served.urls),
        top_k=distill.top_k,
        kept_sets=cfg.trainer.replay.sampling_mask,
        kept_top=cfg.rollout.top_k,
        workers=workers,
    )


def process_rewards(cfg: RunConfig, served: ServedModel | None, tokenizer: Any) -> ProcessRewards:
    """The run's steps (cut at ``reward.process.separator`` with the policy's ``tokenizer``) and its process reward
    model on its engines (``served``; None without one)."""
    w = cfg.reward.process
    cutter = StepCutter(tokenizer, w.separator)
    model = None
    if served is not None:
        model = ProcessRewardModel(served.model, replicas_of(w.engines, served.urls), w.step_token, cutter)
    return ProcessRewards(cutter, model, credit=cfg.trainer.loss.credit.process)


class RolloutManager:
    """The order loop (:meth:`run`): groups started as the trainer orders them, weight updates and syncs applied, the
    replicas' health watched and reported; each group's path is its :class:`GroupRunner`'s."""

    def __init__(self, cfg: RunConfig, spec: ManagerSpec):
        from transformers import AutoTokenizer

        self.cfg, self.r, self.spec = cfg, cfg.rollout, spec
        hf_dir = spec.hf_dir
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        config = json.loads(Path(hf_dir, "config.json").read_text())
        e = cfg.engines
        self.client = EngineClient(
            spec.urls,
            shape=model_shape(config),
            timeout_s=request_timeout_real_s(cfg),
            failures_to_dead=e.health_failures,
            workers=cfg.rollout.generation_workers,
        )
        self.reported: EnginesChanged | None = None  # the replicas' states and losses as last sent to the trainer
        self.cursor, self.reissue = spec.cursor, deque(spec.reissue)
        self.tasks: set[asyncio.Task] = set()
        self.adapters = Adapters(self.client)  # LoRA runs'
        self.serving = asyncio.Event()  # cleared while a weight update is under way (Updating until Served)
        self.serving.set()
        # The config's end tokens may be a list (Qwen's instruct models end a turn at <|im_end|> too).
        ends = config.get("eos_token_id")
        ends = ends if isinstance(ends, list) else [ends]
        stop_ids = sorted(
            {t for t in (tokenizer.eos_token_id, *ends, *cfg.rollout.stop_token_ids) if isinstance(t, int)}
        )
        self.generation = Generation(
            cfg, self.client, self.adapters, self.serving, self._report, uuid.uuid4().hex[:12], stop_ids
        )
        agent = self._agent()
        group_agent: GroupAgent
        schedule = self.r.schedule
        if agent is None:
            self.endpoint = None
            if schedule.policy == "length_aware":
                dispatcher = Dispatcher(self.client.health.usable, GroupLengths(self.r.max_new_tokens), schedule)
                group_agent = SampleRequests(self.generation, tokenizer, dispatcher)
            else:
                group_agent = SingleTurn(self.generation, tokenizer)
        else:
            self.endpoint = EpisodeEndpoint(Path(hf_dir).name)
            group_agent = AgentEpisodes(self.generation, agent, self.endpoint, tokenizer, load_tools(self.r.tools))
        rewarder = Rewarder(cfg.task, *reward_model(cfg, spec.scorers.get("reward")))
        self.groups = GroupRunner(
            self.r.engine_retries,
            PromptStream(cfg.task, tokenizer),
            group_agent,
            rewarder,
            load_filter(self.r.filter_groups),
            teacher(cfg, spec.scorers.get("teacher"), self.client.workers),
            process_rewards(cfg, spec.scorers.get("reward.process"), tokenizer),
        )

    def _agent(self) -> Agent | None:
        """The episodes' agent: none (single-turn groups), a simulation's, or the one ``rollout.agent`` names."""
        if self.r.agent != SIMULATED:
            return load_agent(self.r.agent) if self.r.agent is not None else None
        assert self.cfg.simulation.profile is not None, "checked: config.episode_problems"
        episodes = Profile.load(self.cfg.simulation.profile).episodes
        assert episodes is not None, "checked: preflight.simulation_profile"
        return simulated_agent(episodes, self.cfg.simulation.time_scale, self.r.seed)

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        self.commands, self.events = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        self.commands.connect(self.spec.orders)
        self.events.connect(self.spec.events)
        watch = asyncio.create_task(self._watch(), name="watch")
        if self.endpoint is not None:
            await self.endpoint.start()
        try:
            while True:
                order = checked(await self.commands.recv_pyobj(), ORDERS)
                if isinstance(order, Generate):
                    for _ in range(order.groups):
                        self._start(*((self.reissue.popleft(), False) if self.reissue else (self._next(), True)))
                elif isinstance(order, Updating):
                    self.serving.clear()
                elif isinstance(order, Served):
                    self.serving.set()
                    await self._served(order)
                elif isinstance(order, Restarting):
                    for url in order.urls:
                        self.client.health.restarted(url)
                    await self._report()
                else:
                    break
        finally:
            watch.cancel()
            live = [t for t in self.tasks if not t.done()]
            for t in live:
                t.cancel()
            await asyncio.gather(*live, return_exceptions=True)
            # Only these end at the stop: a task that finished meanwhile has sent its own event.
            cancelled = sorted(int(t.get_name()) for t in live if t.cancelled())
            if live:
                await self.client.abort(quietly=True)  # engines stop generating what nobody will read
            await send_event(self.events, Stopped(cancelled))
            await self.client.close()
            await self.groups.close()
            if self.endpoint is not None:
                await self.endpoint.close()
            self.commands.close(linger=0)
            self.events.close(linger=1000)
            ctx.term()

    async def _served(self, order: Served) -> None:
        # The rotation and the adapter change before the first await, where a waiting request could read them: else
        # it could name the old adapter on a replica a catch-up brought back with only the new one loaded, or the new
        # adapter on a replica the sync passed over that is still in rotation.
        self.client.health.sync_reached(order.weight_version, order.engines, order.also)
        if order.adapter is not None:
            self.adapters.serve(order.adapter, order.version)
        # Those the sync brought back rejoin now, not a probe interval later.
        await self.client.probe_out_of_rotation(order.engines)
        await self._report()
        await self.adapters.unload_unused()

    def _next(self) -> int:
        index, self.cursor = self.cursor, self.cursor + 1
        return index

    def _start(self, index: int, new: bool) -> None:
        task = asyncio.create_task(self._group(index, new), name=str(index))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _group(self, index: int, new: bool) -> None:
        await send_event(self.events, Issued(index, new))
        await send_event(self.events, await self.groups.run(index))

    async def _watch(self) -> None:
        """Probe the replicas out of rotation; tell the trainer when any replica's state changes."""
        while True:
            await self.generation.probes()
            await self._report()
            await asyncio.sleep(self.cfg.engines.health_interval_s)

    async def _report(self) -> None:
        health = self.client.health
        report = EnginesChanged({url: r.state for url, r in health.replicas.items()}, dict(health.losses))
        if report != self.reported:
            self.reported = report
            await send_event(self.events, report)
