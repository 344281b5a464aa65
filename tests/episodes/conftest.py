"""Fixtures for the episode tests: a tiny model served by an embedded engine in the test's own event loop, and a
scripted engine standing for a model that writes given texts."""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import pytest

from moerl.engines.client import EngineClient, Returns
from moerl.engines.protocol import Completion, SamplingParams
from moerl.episodes import Episode, EpisodeSettings, Tool
from moerl.episodes.endpoint import EpisodeEndpoint
from moerl.models import model_shape
from moerl.models.tiny import save_tiny_hf, tiny_tokenizer
from tests.engine_server import serving_app

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="package")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("episodes")
    return save_tiny_hf(ARCH, root / "base"), save_tiny_hf(ARCH, root / "other", seed=1)


@pytest.fixture(scope="package")
def tokenizer():
    return tiny_tokenizer()


@dataclass
class Call:
    """One request an episode made: what it fed, from where it asked for routing, and what came back."""

    input_ids: list[int]
    params: SamplingParams
    start: int
    completion: Completion


@asynccontextmanager
async def served(model_dir, prefix_cache_tokens: int | None = None):
    """An embedded engine serving ``model_dir`` on loopback in this event loop, and a client of it."""
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

    kwargs = {} if prefix_cache_tokens is None else {"prefix_cache_tokens": prefix_cache_tokens}
    shape = model_shape(json.loads((model_dir / "config.json").read_text()))
    async with serving_app(build_app(EmbeddedEngine(str(model_dir), **kwargs))) as url:
        async with EngineClient([url], shape) as client:
            yield client


def engine_generate(client: EngineClient, calls: list[Call], sampling_mask: bool = True):
    """What the rollout manager gives an episode, reduced to one engine request per turn (no retries)."""

    async def generate(input_ids, params, start, top_logprobs):
        (completion,) = await client.generate(
            input_ids,
            params,
            Returns(start, sampling_mask, top_logprobs),
        )
        calls.append(Call(list(input_ids), params, start, completion))
        return completion, None

    return generate


def routing_of(fed: list[int], layers: int = 3, topk: int = 2, experts: int = 8) -> np.ndarray:
    """The scripted engine's routing: a fixed function of each fed position and its token."""
    ids = np.asarray(fed, np.int64)[:, None, None]
    pos = np.arange(len(fed))[:, None, None]
    return ((ids * 7 + pos + np.arange(layers)[None, :, None] * 3 + np.arange(topk)[None, None, :]) % experts).astype(
        np.uint8
    )


@dataclass
class ScriptedEngine:
    """An engine whose model writes ``texts``, one per turn (the chat stop token appended where ``stop`` is given):
    log-probs (and top log-probs where asked), kept sets and routing made up, laid out as the engine lays them out, with
    prefix-cache reuse of what earlier requests fed."""

    tokenizer: object
    texts: list[str]
    stop: str | None = "<|im_end|>"
    version: str = "5"
    calls: list[Call] = field(default_factory=list)
    fed: list[list[int]] = field(default_factory=list)

    async def __call__(self, input_ids, params, start, top_logprobs=0):
        script = self.tokenizer(self.texts[len(self.calls)], add_special_tokens=False)["input_ids"]
        if self.stop is not None:
            script.append(self.tokenizer.convert_tokens_to_ids(self.stop))
        out = script[: params.max_new_tokens]
        finish = {"type": "stop", "matched": out[-1]} if len(out) == len(script) else {"type": "length"}
        seq = list(input_ids) + out
        cached = max((_common(f, input_ids) for f in self.fed), default=0)
        n = len(out)
        kept = [sorted({t, (t + 1) % 256}) for t in out]
        completion = Completion(
            rid=f"scripted-{len(self.calls)}",
            prompt_len=len(input_ids),
            output_ids=np.asarray(out, np.int32),
            finish_reason=finish,
            weight_versions=[{"version": self.version, "start": 0, "end": n}],
            logprobs=np.full(n, -0.5, np.float32),
            routing=routing_of(seq[:-1])[start:],
            routing_start=start,
            cached_tokens=min(cached, len(input_ids) - 1),
            mask_offsets=np.arange(0, 2 * n + 1, 2, dtype=np.int64),
            mask_ids=np.asarray([i for k in kept for i in k], np.int32),
            sampling_logprobs=np.full(n, -0.25, np.float32),
        )
        if top_logprobs:  # the written token first, then the ids after it
            completion.top_ids = (np.asarray(out, np.int32)[:, None] + np.arange(top_logprobs)) % 100
            completion.top_logprobs = np.broadcast_to(
                -0.5 - np.arange(top_logprobs, dtype=np.float32), (n, top_logprobs)
            )
        self.calls.append(Call(list(input_ids), params, start, completion))
        self.fed.append(seq[:-1])
        return completion, None


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def assert_only_seen(sample, calls: list[Call]) -> None:
    """The sample is one stream the engine saw whole, and its actions are exactly the tokens the engine output in it:
    nothing is trained that the model did not see or produce."""
    seq = np.concatenate([sample.prompt_ids, sample.response_ids]).tolist()
    assert any(c.input_ids + c.completion.output_ids.tolist() == seq for c in calls)
    produced = np.zeros(len(seq), bool)
    for c in calls:
        turn = c.input_ids + c.completion.output_ids.tolist()
        if seq[: len(turn)] == turn:  # a turn of this stream
            produced[len(c.input_ids) : len(turn)] = True
    assert np.array_equal(produced[sample.prompt_len :], sample.loss_mask.astype(bool))


RUN_CAP = 120
USER = [{"role": "user", "content": "What is 6 * 7?"}]


@asynccontextmanager
async def endpoint_of(engine: ScriptedEngine, tokenizer, tools: tuple[Tool, ...] = (), **kwargs: Any):
    """An endpoint serving one episode of ``engine`` (its prompt :data:`USER`, the run's cap :data:`RUN_CAP` tokens a
    turn), and the episode."""
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)["input_ids"]
    params = SamplingParams(max_new_tokens=RUN_CAP, top_k=20)
    episode = Episode(prompt, {}, engine, EpisodeSettings(tokenizer, params, sampling_mask=True, tools=tools, **kwargs))
    endpoint = EpisodeEndpoint("policy")
    await endpoint.start()
    endpoint.open(episode)
    try:
        yield episode
    finally:
        await endpoint.close()


async def post(episode: Episode, body: dict) -> tuple[int, dict]:
    """``body`` posted to ``episode``'s chat completions: the status and the JSON answer."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{episode.base_url}/chat/completions", json=body) as r:
            return r.status, await r.json()
