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
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import time
import traceback
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import zmq
import zmq.asyncio

from moerl.engines.client import EngineClient, EngineError, NoHealthyEngine, ReplicaDown
from moerl.engines.generation_workers import WorkerLost
from moerl.engines.health import Probes, SameAnswer
from moerl.engines.protocol import Completion, SamplingParams
from moerl.episodes.agents import SIMULATED, Agent, load_agent, load_tools, simulated_agent
from moerl.episodes.endpoint import EpisodeEndpoint
from moerl.episodes.episode import Episode
from moerl.errors import EnginesDown, leaves
from moerl.models import model_shape
from moerl.orchestrator.config import RunConfig, load_config, request_timeout_real_s
from moerl.orchestrator.messages import (
    ORDERS,
    Dropped,
    DropReason,
    EnginesChanged,
    Generate,
    GroupDone,
    Issued,
    ManagerSpec,
    Restarting,
    RolloutFailed,
    Served,
    Stopped,
    Updating,
    checked,
    send_event,
)
from moerl.sample import Sample
from moerl.simulation import Profile
from moerl.tasks import PromptStream
from moerl.tasks.filters import load_filter
from moerl.tasks.reward_models import COMBINES, RewardModel, Stats, load_named
from moerl.tasks.rewards import Rewarder

log = logging.getLogger("moerl.rollout")
# a prompt whose generation worker dies more often than this stops the run: they keep dying
WORKER_LOSSES_PER_PROMPT = 3
# An episode whose agent failed after its token budget was spent: its samples are whole, and scored.
TRUNCATED = "truncated"


def sampling_seed(run_seed: int, index: int, attempt: int, *more: int) -> int:
    """A per-prompt seed (``more``: an episode's index): under the same weights the same prompt index draws the same
    completions from the embedded and simulated engines; SGLang samples without it (see
    protocol.SamplingParams.sampling_seed)."""
    return int(np.random.SeedSequence([run_seed, index, attempt, *more]).generate_state(1)[0] >> 1)


def reward_model(
    cfg: RunConfig, model_dir: str | None, urls: list[str]
) -> tuple[RewardModel | None, Callable[[float, float], float] | None]:
    """The run's reward model (its HF directory ``model_dir``) on its engines ``urls``, and how its score combines with
    the task's reward (None, None without one)."""
    w = cfg.reward
    if model_dir is None:
        return None, None
    e = w.engines
    model = RewardModel(
        urls,
        model_dir,
        w.kind,
        w.judge_prompt,
        w.verdict,
        w.judge_max_new_tokens,
        timeout_s=e.request_timeout_s or 600.0,
        down_timeout_s=e.down_timeout_s,
        health_interval_s=e.health_interval_s,
        failures_to_dead=e.health_failures,
    )
    return model, load_named(w.combine, COMBINES, "reward.combine")


class PromptDropped(Exception):
    """A prompt's replicas failed more often than ``rollout.engine_retries``: its group is dropped (engine_failure)."""


@dataclass
class Tries:
    """How often a prompt's group was asked for again so far, by why: what its GroupDone or Dropped event reports."""

    attempt: int = 0  # regenerations after weight updates aborted it (rollout.partial=retry)
    engine_retries: int = 0  # re-issues after its replica failed
    workers_lost: int = 0  # re-issues after the generation worker carrying it died


class RolloutManager:
    def __init__(self, cfg: RunConfig, spec: ManagerSpec):
        from transformers import AutoTokenizer

        self.cfg, self.r, self.spec = cfg, cfg.rollout, spec
        hf_dir = spec.hf_dir
        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        self.stream = PromptStream(cfg.task, self.tokenizer)
        self.rewarder = Rewarder(cfg.task, *reward_model(cfg, spec.reward_model, spec.reward_urls))
        config = json.loads(Path(hf_dir, "config.json").read_text())
        e = cfg.engines
        self.client = EngineClient(
            spec.urls,
            shape=model_shape(config),
            timeout_s=request_timeout_real_s(cfg),
            failures_to_dead=e.health_failures,
            workers=cfg.rollout.generation_workers,
        )
        # those of the replicas out of rotation: the watch's, and those of the requests waiting for a replica
        self.probes = Probes(self.client, e.health_interval_s)
        # every replica failing every request with one error: a prompt's retries on each of them, and the run stops
        self.same_answer = SameAnswer(self.client.urls, (cfg.rollout.engine_retries + 1) * len(self.client.urls))
        self.reported: EnginesChanged | None = None  # the replicas' states and losses as last sent to the trainer
        self.cursor, self.reissue = spec.cursor, deque(spec.reissue)
        self.tasks: set[asyncio.Task] = set()
        # LoRA runs: the adapter new requests use and its policy version (none: the base model, version 0),
        # how many requests use each adapter, and the older ones still loaded on the engines.
        self.adapter: tuple[str | None, int] = (None, 0)
        self.users: dict[str, int] = {}
        self.retired: set[str] = set()
        self.salt = uuid.uuid4().hex[
            :12
        ]  # this manager's prefix-cache keys: engines given by URL hold other runs' prefixes
        self.serving = asyncio.Event()  # cleared while a weight update is under way (Updating until Served)
        self.serving.set()
        # The config's end tokens may be a list (Qwen's instruct models end a turn at <|im_end|> too).
        ends = config.get("eos_token_id")
        ends = ends if isinstance(ends, list) else [ends]
        self.stop_ids = sorted(
            {t for t in (self.tokenizer.eos_token_id, *ends, *cfg.rollout.stop_token_ids) if isinstance(t, int)}
        )
        self.agent = self._agent()
        self.keep = load_filter(self.r.filter_groups)
        self.tools = load_tools(self.r.tools)
        self.endpoint = EpisodeEndpoint(Path(hf_dir).name) if self.agent is not None else None

    def _agent(self) -> Agent | None:
        """The run's agent: none (single-turn groups), a simulation's, or the one ``rollout.agent`` names."""
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
            await self.rewarder.close()
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
            # the same one again: re-served after a verify passed an engine over
            if self.adapter[0] not in (None, order.adapter):
                self.retired.add(self.adapter[0])
            self.adapter = (order.adapter, order.version)
            log.info("new requests use adapter %s (policy version %d)", *self.adapter)
        # Those the sync brought back rejoin now, not a probe interval later.
        await self.client.probe_out_of_rotation(order.engines)
        await self._report()
        await self._unload_unused()

    def _next(self) -> int:
        index, self.cursor = self.cursor, self.cursor + 1
        return index

    def _start(self, index: int, new: bool) -> None:
        task = asyncio.create_task(self._group(index, new), name=str(index))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _unload_unused(self) -> None:
        # Picked one at a time: other requests finishing during an unload call this too, and each adapter
        # must leave ``retired`` before anyone awaits its unload.
        while unused := sorted(n for n in self.retired if not self.users.get(n)):
            self.retired.discard(unused[0])
            try:
                await self.client.unload_lora(unused[0])
            except EngineError as e:  # a replica that is down lost it anyway; one that restarts never had it
                log.warning("unloading adapter %s: %s", unused[0], e)
                continue
            log.info("unloaded adapter %s: no request uses it", unused[0])

    async def _group(self, index: int, new: bool) -> None:
        """Prompt ``index``'s group, generated and scored, sent as :class:`GroupDone` (or :class:`Dropped`, or
        :class:`RolloutFailed`)."""
        try:
            await send_event(self.events, Issued(index, new))
            record, ids = self.stream.get(index)
            tries, start, scoring = Tries(), time.perf_counter(), Stats(float)
            episodes: dict[str, float] | None = None
            try:
                if self.agent is None:
                    samples = await self._completions(index, record, ids, tries, scoring)
                else:
                    samples, episodes = await self._episodes(index, record, ids, tries, scoring)
            except PromptDropped as e:
                log.warning(
                    "prompt %d dropped (engine_failure) after %d re-issues: %s", index, self.r.engine_retries, e
                )
                await send_event(
                    self.events, Dropped(index, DropReason.ENGINE_FAILURE, tries.engine_retries - 1, tries.workers_lost)
                )
                return
            if not samples:  # every episode of the group failed
                await send_event(
                    self.events, Dropped(index, DropReason.EPISODE_FAILURE, tries.engine_retries, tries.workers_lost)
                )
                return
            if self.keep is not None and not self.keep(samples):
                rewards = tuple(s.reward for s in samples)
                await send_event(
                    self.events, Dropped(index, DropReason.FILTERED, tries.engine_retries, tries.workers_lost, rewards)
                )
                return
            await send_event(
                self.events,
                GroupDone(
                    index,
                    samples,
                    tries.attempt,
                    time.perf_counter() - start,
                    tries.engine_retries,
                    tries.workers_lost,
                    episodes,
                    dict(scoring) if self.rewarder.model is not None else None,
                ),
            )
        except asyncio.CancelledError:
            raise
        except EnginesDown as e:
            await send_event(self.events, RolloutFailed(index, str(e), engines_down=True))
        except Exception as e:  # noqa: BLE001 - whatever fails a prompt, the trainer stops the run with its message
            log.exception("rollout of prompt %d failed", index)  # the trainer says its first line; here, the whole
            await send_event(self.events, RolloutFailed(index, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))

    def _params(self, index: int, n: int) -> SamplingParams:
        r = self.r
        return SamplingParams(
            n=n,
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            max_new_tokens=r.max_new_tokens,
            stop_token_ids=self.stop_ids,
            sampling_seed=sampling_seed(r.seed, index, 0),
        )

    def _versions(self, completions: list[Completion], adapter_version: int) -> dict[str, int] | None:
        """The policy version of each weight version the completions name: under LoRA the engines' weights never
        change, and the adapter a request used is its tokens' policy. None: the weight versions are the policy's."""
        if not self.cfg.lora.enabled:
            return None
        return {span["version"]: adapter_version for c in completions for span in c.weight_versions}

    async def _completions(
        self, index: int, record: dict, ids: list[int], tries: Tries, scoring: Stats
    ) -> list[Sample]:
        """A single-turn group: ``samples_per_prompt`` completions of the prompt in one request, scored (``scoring``:
        the reward model's counts)."""
        completions, adapter_version = await self._generate(
            index, ids, tries, self._params(index, self.r.samples_per_prompt), tag=f"p{index}"
        )
        # one sequence decodes to one text (transformers types decode's result for a batch of them too)
        texts = [cast(str, self.tokenizer.decode(c.output_ids, skip_special_tokens=True)) for c in completions]
        rewards = await self.rewarder.score(texts, record["answer"], record["prompt"], scoring)
        versions = self._versions(completions, adapter_version)
        return [
            Sample.from_completion(c, ids, temperature=self.r.temperature, reward=x, group_id=index, versions=versions)
            for c, x in zip(completions, rewards, strict=True)  # Rewarder.score: one reward per response
        ]

    async def _episodes(
        self, index: int, record: dict, ids: list[int], tries: Tries, scoring: Stats
    ) -> tuple[list[Sample], dict[str, float]]:
        """An agentic group: ``samples_per_prompt`` episodes run at once by the agent, each turn a request of its own
        (on any replica: each turn's routing and versions travel with its tokens), scored; and the group's episode
        counts. An episode whose agent raises or outlives ``rollout.episode_timeout_s`` is left out, counted by
        reason; one turn dropped past its engine retries drops the group."""
        r = self.r
        episodes = [
            Episode(
                ids,
                record,
                functools.partial(self._turn, index, tries, k),
                self.tokenizer,
                self._params(index, 1).model_copy(update={"sampling_seed": sampling_seed(r.seed, index, 0, k)}),
                group_id=index,
                index=k,
                routing=True,  # under every replay mode: the agreement metrics compare against it
                sampling_mask=self.cfg.trainer.replay.sampling_mask,
                tools=self.tools,
                max_total_tokens=r.max_episode_tokens,
            )
            for k in range(r.samples_per_prompt)
        ]
        try:
            async with asyncio.TaskGroup() as group:
                runs = [group.create_task(self._run_agent(e)) for e in episodes]
        except* (PromptDropped, EnginesDown) as ended:
            raise min(leaves(ended), key=lambda e: not isinstance(e, EnginesDown)) from None  # the run's end first
        results = [run.result() for run in runs]
        finished = [
            (e, reward) for e, (reward, ending) in zip(episodes, results, strict=True) if ending in (None, TRUNCATED)
        ]
        unscored = [e for e, reward in finished if reward is None]
        scores = iter(
            await self.rewarder.score([e.final_text for e in unscored], record["answer"], record["prompt"], scoring)
        )
        samples = [
            sample
            for e, reward in finished
            for sample in e.samples(next(scores) if reward is None else reward, r.temperature)
        ]
        counts: Counter[str] = Counter({"episode/episodes": len(episodes)})
        for e in episodes:
            counts.update(e.stats.metrics())
        counts["episode/truncated"] = sum(e.finish_reason == "length" for e in episodes)
        counts["episode/truncated_agent_failed"] = sum(ending == TRUNCATED for _, ending in results)
        counts.update(f"episode/failed_{ending}" for _, ending in results if ending not in (None, TRUNCATED))
        return samples, dict(counts)

    async def _run_agent(self, episode: Episode) -> tuple[float | None, str | None]:
        """The agent's reward for ``episode`` (None: the task's reward function scores it) and how it ended: None
        (it returned), TRUNCATED (it failed after the episode's token budget was spent: scored as it stands, since
        its samples are whole), or why it failed (its samples are left out). What the agent raised is read through
        any exception groups it nests: engines down (the run's end) and a dropped prompt (the group's) pass on,
        wherever they surfaced, as does a cancellation of this task."""
        assert self.agent is not None and self.endpoint is not None  # an agentic run
        key = self.endpoint.open(episode)
        raised: BaseException | None = None
        try:
            async with asyncio.timeout(self.r.episode_timeout_s) as deadline:
                reward = await self.agent(episode, episode.record)
        except BaseException as e:  # noqa: BLE001 - classified below, by what it stands for
            raised = e
        finally:
            self.endpoint.close_episode(key)
        failure = self.endpoint.failures.pop(key, None)
        found = [*([] if raised is None else leaves(raised)), *([] if failure is None else [failure])]
        for ending in (EnginesDown, PromptDropped):  # the run's end, then the group's: not the episode's
            for cause in found:
                if isinstance(cause, ending):
                    raise cause
        if isinstance(raised, KeyboardInterrupt | SystemExit):
            raise raised
        task = asyncio.current_task()
        if raised is not None and task is not None and task.cancelling():
            raise raised if isinstance(raised, asyncio.CancelledError) else asyncio.CancelledError() from raised
        if raised is None and failure is None:
            if reward is not None and not isinstance(reward, int | float):
                return None, self._failed(
                    episode, "agent_error", f"the agent returned {type(reward).__name__}, not a reward"
                )
            return (None if reward is None else float(reward)), None
        if deadline.expired():
            reason, detail = "timeout", f"past rollout.episode_timeout_s={self.r.episode_timeout_s:g}"
        elif failure is not None:
            reason, detail = "agent_error", f"a call to its endpoint failed: {failure}"
        else:
            assert raised is not None
            reason, detail = "agent_error", "; ".join(f"{type(leaf).__name__}: {leaf}" for leaf in leaves(raised))
        if episode.finish_reason == "length" and failure is None:
            log.info(
                "episode %d of prompt %d is scored: its token budget was spent before its agent failed (%s): %s",
                episode.index,
                episode.group_id,
                reason,
                detail,
            )
            return None, TRUNCATED
        return None, self._failed(episode, reason, detail)

    @staticmethod
    def _failed(episode: Episode, reason: str, detail: str) -> str:
        log.warning("episode %d of prompt %d failed (%s): %s", episode.index, episode.group_id, reason, detail)
        return reason

    async def _turn(
        self,
        index: int,
        tries: Tries,
        k: int,
        input_ids: list[int],
        params: SamplingParams,
        routing_start: int,
        top_logprobs: int,
    ) -> tuple[Completion, dict[str, int] | None]:
        """One turn of episode ``k`` of prompt ``index``: what :class:`Episode` asks of the engines."""
        (completion,), adapter_version = await self._generate(
            index,
            input_ids,
            tries,
            params,
            routing_start=routing_start,
            top_logprobs=top_logprobs,
            tag=f"p{index}-x{k}-l{len(input_ids)}",
            affinity=f"{self.salt}-p{index}",  # the group's episodes share its prompt's prefix on one replica
        )
        return completion, self._versions([completion], adapter_version)

    async def _generate(
        self,
        index: int,
        ids: list[int],
        tries: Tries,
        params: SamplingParams,
        routing_start: int = 0,
        top_logprobs: int = 0,
        tag: str = "",
        affinity: str | None = None,
    ) -> tuple[list[Completion], int]:
        """``params.n`` completions of ``ids`` (routing rows from ``routing_start``) and the policy version of the
        adapter they used (0: the base model), asked for again as often as ``tries`` counts: a weight update that
        aborted them (``rollout.partial=retry``) regenerates them under the new weights with a new seed; ``affinity``:
        a key that keeps requests on one replica while it is healthy (:meth:`EngineClient.generate`). Raises
        :class:`PromptDropped` once prompt ``index``'s replicas failed more than ``rollout.engine_retries`` times."""
        r = self.r
        regenerations, seed = 0, params.sampling_seed
        while True:
            await self.serving.wait()  # no request while a weight update is under way: see Updating
            # Before the adapter is read: a replica that comes back after this wait holds only the current one.
            await self.client.until_usable(
                self.cfg.engines.down_timeout_s,
                "engines.down_timeout_s",
                min(self.cfg.engines.health_interval_s, 0.5),
                self.probes,
            )
            adapter, adapter_version = self.adapter
            served = self.client.health.served
            if regenerations and seed is not None:
                params = params.model_copy(update={"sampling_seed": sampling_seed(seed, index, regenerations)})
            if adapter is not None:
                self.users[adapter] = self.users.get(adapter, 0) + 1
            try:
                completions = await self.client.generate(
                    # Routing comes back under every replay mode: the agreement metrics compare against it.
                    ids,
                    params,
                    return_routed_experts=True,
                    routed_experts_start_len=routing_start,
                    lora_path=adapter,
                    return_sampling_mask=self.cfg.trainer.replay.sampling_mask,
                    top_logprobs=top_logprobs,
                    rid=f"{tag}-a{tries.attempt}-e{tries.engine_retries}-w{tries.workers_lost}",
                    # The prompt reuses only KV computed under the policy it is issued under: no request is issued
                    # during an update (Updating), and engines do not flush their prefix cache on an update while
                    # requests run. Those in flight keep theirs, as an in-place update defines.
                    extra_key=f"moerl-{self.salt}-v{adapter_version if adapter is not None else served}",
                    affinity=affinity,
                )
            except NoHealthyEngine:
                continue  # the last healthy replica left between the wait and the request: wait again
            except WorkerLost as e:  # not the engine's failure: re-issued without counting against its engine retries
                self._count_worker_lost(index, e, tries)
                if adapter in self.retired:
                    await self._unload_unused()
                continue
            except ReplicaDown as e:
                await self._report()
                if self.same_answer.failed(e.url, e.status, e.message):
                    raise EnginesDown(
                        f"every engine answers the run's requests with the same error, {self.same_answer.count} in a "
                        f"row with none served between: {e.message}; they cannot serve this run as configured"
                    ) from None
                tries.engine_retries += 1
                if tries.engine_retries > r.engine_retries:
                    raise PromptDropped(str(e)) from None
                log.warning("prompt %d re-issued (%d of %d): %s", index, tries.engine_retries, r.engine_retries, e)
                if adapter in self.retired:
                    await self._unload_unused()
                continue  # the same seed, on another replica
            finally:
                if adapter is not None:
                    self.users[adapter] -= 1
            self.same_answer.served()
            if adapter in self.retired:
                await self._unload_unused()
            aborted = any(c.finish_reason.get("type") == "abort" for c in completions)
            if not (aborted and r.partial == "retry"):
                return completions, adapter_version
            tries.attempt += 1  # a weight update aborted it: regenerate it (an episode: only this turn) anew
            regenerations += 1

    @staticmethod
    def _count_worker_lost(index: int, error: WorkerLost, tries: Tries) -> None:
        """Count a re-issue of prompt ``index`` after its generation worker died; raise once they keep dying."""
        tries.workers_lost += 1
        if tries.workers_lost > WORKER_LOSSES_PER_PROMPT:
            raise RuntimeError(
                f"the generation worker carrying prompt {index} died {tries.workers_lost} times (last: {error}); they "
                "are being killed (for memory?): give the manager's host more memory, or set "
                "rollout.generation_workers=0 to carry generations in the manager itself"
            ) from None
        log.warning("prompt %d re-issued: %s", index, error)

    async def _watch(self) -> None:
        """Probe the replicas out of rotation; tell the trainer when any replica's state changes."""
        while True:
            await self.probes()
            await self._report()
            await asyncio.sleep(self.cfg.engines.health_interval_s)

    async def _report(self) -> None:
        health = self.client.health
        report = EnginesChanged({url: r.state for url, r in health.replicas.items()}, dict(health.losses))
        if report != self.reported:
            self.reported = report
            await send_event(self.events, report)


def configure_logging() -> None:
    """moerl's own INFO lines; other libraries' warnings only (an agent's HTTP client logs each request at INFO)."""
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("moerl").setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m moerl.orchestrator.manager", description="Rollout manager (started by the main job)."
    )
    p.add_argument("--spec", required=True, help="JSON written by the trainer: config, engines, sockets, data position")
    args = p.parse_args(argv)
    configure_logging()
    spec = ManagerSpec.read(args.spec)
    manager = RolloutManager(load_config(spec.config, []), spec)
    asyncio.run(manager.run())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
