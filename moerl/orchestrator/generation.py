"""A prompt's engine requests, as the rollout manager sends them: none during a weight update, each on a usable
replica under the current LoRA adapter, and each asked again where a replica fails, a generation worker dies, or a
weight update aborts it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass

import numpy as np

from moerl.engines.client import EngineClient, NoHealthyEngine, ReplicaDown, Returns
from moerl.engines.generation_workers import WorkerLost
from moerl.engines.health import Probes, SameAnswer
from moerl.engines.protocol import Completion, SamplingParams
from moerl.errors import EnginesDown
from moerl.orchestrator.adapters import Adapters
from moerl.orchestrator.config import RunConfig

log = logging.getLogger("moerl.rollout")
# a prompt whose generation worker dies more often than this stops the run: they keep dying
WORKER_LOSSES_PER_PROMPT = 3


def sampling_seed(run_seed: int, index: int, attempt: int, *more: int) -> int:
    """A per-prompt seed (``more``: an episode's index): under the same weights the same prompt index draws the same
    completions from the embedded and simulated engines; SGLang samples without it (see
    protocol.SamplingParams.sampling_seed)."""
    return int(np.random.SeedSequence([run_seed, index, attempt, *more]).generate_state(1)[0] >> 1)


class PromptDropped(Exception):
    """A prompt's replicas failed more often than ``rollout.engine_retries``: its group is dropped (engine_failure)."""


@dataclass
class Tries:
    """How often a prompt's group was asked for again so far, by why: what its GroupDone or Dropped event reports."""

    attempt: int = 0  # regenerations after weight updates aborted it (rollout.partial=retry)
    engine_retries: int = 0  # re-issues after its replica failed
    workers_lost: int = 0  # re-issues after the generation worker carrying it died
    continued: int = 0  # requests that continued a completion cut at rollout.schedule.chunk_tokens
    moved: int = 0  # of those, the ones on another replica than the piece before
    tail: int = 0  # requests placed as tail requests (rollout.schedule.tail_tokens)


class Generation:
    """The run's requests to its engines (``client``), each asked again as its prompt's :class:`Tries` allow.

    ``serving``: cleared while a weight update is under way; ``report``: tells the trainer the replicas' states (after
    one failed); ``salt``: this manager's prefix-cache keys (engines given by URL hold other runs' prefixes);
    ``stop_ids``: the tokens a completion ends at."""

    def __init__(
        self,
        cfg: RunConfig,
        client: EngineClient,
        adapters: Adapters,
        serving: asyncio.Event,
        report: Callable[[], Awaitable[None]],
        salt: str,
        stop_ids: list[int],
    ):
        self.cfg, self.r, self.stop_ids = cfg, cfg.rollout, stop_ids
        self.client, self.adapters, self.serving, self.report, self.salt = client, adapters, serving, report, salt
        # those of the replicas out of rotation: the manager's watch's, and those of the requests waiting for a replica
        self.probes = Probes(client, cfg.engines.health_interval_s)
        # every replica failing every request with one error: a prompt's retries on each of them, and the run stops
        self.same_answer = SameAnswer(client.urls, (self.r.engine_retries + 1) * len(client.urls))

    def params(self, index: int, n: int) -> SamplingParams:
        """How ``n`` completions of prompt ``index`` sample, seeded by the run's seed and the index."""
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

    def versions(self, completions: list[Completion], adapter_version: int) -> dict[str, int] | None:
        """The policy version of each weight version the completions name: under LoRA the engines' weights never
        change, and the adapter a request used is its tokens' policy. None: the weight versions are the policy's."""
        if not self.cfg.lora.enabled:
            return None
        return {span["version"]: adapter_version for c in completions for span in c.weight_versions}

    async def __call__(
        self,
        index: int,
        ids: list[int],
        tries: Tries,
        params: SamplingParams,
        routing_start: int = 0,
        top_logprobs: int = 0,
        tag: str = "",
        affinity: str | None = None,
        slot: Callable[[], AbstractAsyncContextManager[str | None]] | None = None,
    ) -> tuple[list[Completion], int]:
        """``params.n`` completions of ``ids`` (routing rows from ``routing_start``) and the policy version of the
        adapter they used (0: the base model), asked for again as often as ``tries`` counts: a weight update that
        aborted them (``rollout.partial=retry``) regenerates them under the new weights with a new seed; ``affinity``:
        a key that keeps requests on one replica while it is healthy (:meth:`EngineClient.generate`); ``slot``: the
        replica a scheduler gives each try, held while it runs (:meth:`~moerl.orchestrator.scheduling.Dispatcher.slot`).
        Raises
        :class:`PromptDropped` once prompt ``index``'s replicas failed more than ``rollout.engine_retries`` times."""
        r = self.r
        regenerations, seed = 0, params.sampling_seed
        while True:
            # the replica first: a request waits for one in the scheduler's queue, then for the engines to serve
            async with nullcontext() if slot is None else slot() as replica:
                await self.serving.wait()  # no request while a weight update is under way: see Updating
                # Before the adapter is read: a replica that comes back after this wait holds only the current one.
                await self.client.until_usable(
                    self.cfg.engines.down_timeout_s,
                    "engines.down_timeout_s",
                    min(self.cfg.engines.health_interval_s, 0.5),
                    self.probes,
                )
                served = self.client.health.served
                if regenerations and seed is not None:
                    params = params.model_copy(update={"sampling_seed": sampling_seed(seed, index, regenerations)})
                adapter, adapter_version = self.adapters.acquire()
                try:
                    completions = await self.client.generate(
                        # Routing comes back under every replay mode: the agreement metrics compare against it.
                        ids,
                        params,
                        Returns(routing_start, self.cfg.trainer.replay.sampling_mask, top_logprobs),
                        lora_path=adapter,
                        rid=f"{tag}-a{tries.attempt}-e{tries.engine_retries}-w{tries.workers_lost}",
                        # The prompt reuses only KV computed under the policy it is issued under: no request is issued
                        # during an update (Updating), and engines do not flush their prefix cache on an update while
                        # requests run. Those in flight keep theirs, as an in-place update defines.
                        extra_key=f"moerl-{self.salt}-v{adapter_version if adapter is not None else served}",
                        affinity=affinity,
                        replica=replica,
                    )
                except NoHealthyEngine:  # the last healthy replica left between the wait and the request: wait again
                    completions = None
                except WorkerLost as e:  # not the engine's failure: re-issued, not counted against its engine retries
                    self._count_worker_lost(index, e, tries)
                    completions = None
                except ReplicaDown as e:
                    await self.report()
                    if self.same_answer.failed(e.url, e.status, e.message):
                        raise EnginesDown(
                            "every engine answers the run's requests with the same error, "
                            f"{self.same_answer.count} in a row with none served between: {e.message}; they cannot "
                            "serve this run as configured"
                        ) from None
                    tries.engine_retries += 1
                    if tries.engine_retries > r.engine_retries:
                        raise PromptDropped(str(e)) from None
                    log.warning("prompt %d re-issued (%d of %d): %s", index, tries.engine_retries, r.engine_retries, e)
                    completions = None
                finally:
                    self.adapters.release(adapter)
                # this request no longer uses its adapter, whether it was answered or is asked again
                await self.adapters.unload_if_retired(adapter)
            if completions is None:
                continue  # the same seed, on another replica (or the same, once its worker is replaced)
            self.same_answer.served()
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
