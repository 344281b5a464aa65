"""The embedded engine end to end: a real ``moerl serve`` process on loopback, driven by moerl's
client (and raw HTTP for what a client would never send)."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.engines.client import TOKENS_ONLY, EngineClient, EngineError, Returns
from moerl.engines.protocol import ProtocolError
from moerl.models import model_shape
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_server

ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[3, 17, 42, 99, 7], [11, 12, 13], [200, 5, 9, 31, 64, 2, 77, 18, 150], [60, 61]]

ROUTING = Returns(routing_from=0)  # every fed position's routed experts


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    return save_tiny_hf(ARCH, root / "base"), save_tiny_hf(ARCH, root / "other", seed=1)


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with running_server(models[0], tmp_path_factory.mktemp("log")) as url:
        yield url


@pytest.fixture(scope="module")
def shape(models):
    return model_shape(json.loads((models[0] / "config.json").read_text()))


@pytest.fixture(scope="module")
def reference(models):
    return AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval()


def run(coro):
    return asyncio.run(coro)


async def _generate_all(url, shape, params, returns=TOKENS_ONLY):
    async with EngineClient([url], shape) as client:
        return await asyncio.gather(*(client.generate(p, params, returns) for p in PROMPTS))


def _recompute(model, prompt, output):
    """Logits and per-MoE-layer top-k of the whole sequence run again in one forward."""
    ids = torch.tensor([list(prompt) + output.tolist()[:-1]])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    topk = model.config.num_experts_per_tok
    routing = torch.stack(
        [torch.topk(torch.softmax(r.float(), -1), topk, -1).indices for r in out.router_logits], dim=1
    )
    return out.logits[0], routing


@pytest.mark.e2e
def test_routing_equals_the_routing_of_a_full_rerun(server, shape, reference):
    params = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7}
    results = run(_generate_all(server, shape, params, ROUTING))
    for prompt, (c,) in zip(PROMPTS, results, strict=True):
        _, routing = _recompute(reference, prompt, c.output_ids)
        assert c.routing.dtype == np.uint8
        assert c.routing.shape == (len(prompt) + len(c.output_ids) - 1, len(shape.moe_layers), shape.topk)
        # Same expert sets per token and layer (order within the top-k may differ on near-ties).
        assert np.array_equal(np.sort(c.routing, -1), np.sort(routing.numpy(), -1))


@pytest.mark.e2e
def test_routed_experts_start_len_drops_prompt_rows(server, shape):
    async def go():
        async with EngineClient([server], shape) as client:
            full = await client.generate(PROMPTS[2], {"max_new_tokens": 4, "sampling_seed": 1}, ROUTING)
            part = await client.generate(
                PROMPTS[2],
                {"max_new_tokens": 4, "sampling_seed": 1},
                Returns(routing_from=5),
            )
            return full[0], part[0]

    full, part = run(go())
    assert np.array_equal(full.output_ids, part.output_ids)
    assert np.array_equal(part.routing, full.routing[5:])


@pytest.mark.e2e
@pytest.mark.parametrize(
    "params",
    [
        {"top_k": 20, "top_p": 0.9, "temperature": 0.8},
        {"top_k": 50, "min_p": 0.05},
        {"top_k": 1},
    ],
)
def test_sampled_tokens_lie_in_their_kept_set_and_logprobs_match(server, shape, reference, params):
    params = {**params, "max_new_tokens": 10, "sampling_seed": 3, "ignore_eos": True}
    results = run(_generate_all(server, shape, params, Returns(sampling_mask=True)))
    temperature = params.get("temperature", 1.0)
    for prompt, (c,) in zip(PROMPTS, results, strict=True):
        logits, _ = _recompute(reference, prompt, c.output_ids)
        logprobs = torch.log_softmax(logits[len(prompt) - 1 :].float() / temperature, -1)
        for t, token in enumerate(c.output_ids):
            kept = c.mask_ids[c.mask_offsets[t] : c.mask_offsets[t + 1]]  # token t's kept set (CSR)
            assert token in kept
            assert len(kept) <= params["top_k"]
            if params["top_k"] == 1:
                assert kept.tolist() == [int(logits[len(prompt) - 1 + t].argmax())]
            renormalised = logprobs[t, token] - torch.logsumexp(logprobs[t, torch.from_numpy(kept).long()], 0)
            assert c.sampling_logprobs[t] == pytest.approx(float(renormalised), abs=1e-4)
            assert c.logprobs[t] == pytest.approx(float(logprobs[t, token]), abs=1e-4)


@pytest.mark.e2e
def test_each_completion_returns_when_it_finishes(server, shape):
    async def go():
        order = []
        async with EngineClient([server], shape) as client:
            prompts = [
                (PROMPTS[0], {"max_new_tokens": 120, "ignore_eos": True}),
                (PROMPTS[1], {"max_new_tokens": 2, "ignore_eos": True}),
            ]
            for next_done in asyncio.as_completed([client.generate(ids, params) for ids, params in prompts]):
                (c,) = await next_done
                order.append(len(c.output_ids))
        return order

    assert run(go()) == [2, 120]


@pytest.mark.e2e
def test_same_seed_same_completion_alone_or_batched(server, shape):
    params = {"max_new_tokens": 16, "sampling_seed": 11, "top_k": 30}

    async def go():
        async with EngineClient([server], shape) as client:
            alone = await client.generate(PROMPTS[0], params)
            batched = await asyncio.gather(*(client.generate(p, params) for p in PROMPTS))
            return alone[0], batched[0][0]

    alone, batched = run(go())
    assert np.array_equal(alone.output_ids, batched.output_ids)


@pytest.mark.parametrize("n", [1, 3])
def test_completions_waiting_on_disk_come_back_byte_for_byte_a_slice_at_a_time(models, monkeypatch, n):
    """A finished completion past SPILL_BYTES waits in a temporary file for the rest of its n and for its client (the
    last to finish too): the answer is the same bytes as one held in memory, the socket is handed it SEND_CHUNK_BYTES at
    a time (what an answer its client does not read yet holds in the engine's memory), and no file stays open."""
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from moerl.engines.embedded import streaming
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.server import build_app

    body = {
        "input_ids": PROMPTS[0],
        "rid": "spilled",
        "return_logprob": True,
        "return_routed_experts": True,
        "return_sampling_mask": True,
        "sampling_params": {"n": n, "max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 5, "top_k": 20},
    }
    files, writes = [], []

    def temporary_file():
        files.append(made := real_temporary_file())
        return made

    async def write(self, data) -> None:
        writes.append(len(data))
        await real_write(self, data)

    real_temporary_file, real_write = streaming.tempfile.TemporaryFile, web.StreamResponse.write
    monkeypatch.setattr(streaming.tempfile, "TemporaryFile", temporary_file)

    async def answer() -> bytes:
        async with TestClient(TestServer(build_app(EmbeddedEngine(str(models[0]))))) as client:
            resp = await client.post("/generate", json=body)
            assert resp.status == 200
            return await resp.read()

    held = run(answer())
    assert not files
    monkeypatch.setattr(streaming, "SPILL_BYTES", 0)
    monkeypatch.setattr(streaming, "SEND_CHUNK_BYTES", 256)
    monkeypatch.setattr(web.StreamResponse, "write", write)
    spilled = run(answer())
    assert len(files) == n and all(f.closed for f in files)
    assert spilled == held and len(json.loads(spilled) if n > 1 else [json.loads(spilled)]) == n
    assert sum(writes) == len(held) > 4 * 256 * n and max(writes) <= 256


@pytest.mark.e2e
def test_stream_of_n_completions_tags_each_chunk_with_its_index(server):
    async def go():
        chunks = []
        async with aiohttp.ClientSession() as session:
            body = {
                "input_ids": PROMPTS[0],
                "sampling_params": {"n": 3, "max_new_tokens": 5, "ignore_eos": True},
                "stream": True,
            }
            async with session.post(server + "/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        chunks.append(json.loads(line[6:]))
        return chunks

    by_index: dict[int, list] = {}
    for chunk in run(go()):
        by_index.setdefault(chunk["index"], []).append(chunk)
    assert sorted(by_index) == [0, 1, 2]
    for chunks in by_index.values():
        assert len({c["meta_info"]["id"] for c in chunks}) == 1
        assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5]
        assert all(a["output_ids"] == b["output_ids"][: len(a["output_ids"])] for a, b in itertools.pairwise(chunks))
        assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


async def _post(url, route, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body) as r:
            return r.status, await r.json(content_type=None)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "body, message",
    [
        ({"input_ids": [1, 2], "return_routed_expert": True}, "unknown or unsupported field(s): return_routed_expert"),
        ({"input_ids": []}, "input_ids is empty"),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens: Input should be greater than or equal to 0",
        ),
        (
            {"input_ids": [1], "return_sampling_mask": True, "sampling_params": {"top_k": -1}},
            "return_sampling_mask needs a finite top_k",
        ),
        (
            {"input_ids": [1], "lora_path": "nope"},
            "Got LoRA adapter that has never been loaded: nope",
        ),  # SGLang's words
        ({"input_ids": [1, 9999]}, "outside the vocabulary"),
    ],
)
def test_bad_requests_get_400_and_the_server_keeps_serving(server, shape, body, message):
    status, answer = run(_post(server, "/generate", body))
    assert status == 400 and message in answer["error"]["message"]
    # ignore_eos: the random model may draw its EOS first, and the check is that the server still generates.
    (c,) = run(_generate_all(server, shape, {"max_new_tokens": 2, "ignore_eos": True}))[0]
    assert len(c.output_ids) == 2


@pytest.mark.e2e
def test_client_raises_the_engines_message_on_a_refusal(server, shape):
    async def go(ids, params):
        async with EngineClient([server], shape) as client:
            await client.generate(ids, params)

    # What only the engine can know (its vocabulary) comes back as its 400 message ...
    with pytest.raises(EngineError, match=r"refused \(400\): input_ids has ids outside the vocabulary \[0, 256\)"):
        run(go([1, 9999], {}))
    # ... and a body the contract refuses is never sent.
    with pytest.raises(ProtocolError, match=r"top_p: Input should be greater than 0"):
        run(go([1, 2], {"top_p": 0}))


# ---- the prefix cache
# -------------------------------------------------------------------------------------------------
LONG_PROMPT = [3, 17, 42, 99, 7, 11, 12, 13, 200, 5, 9, 31, 64, 2]


def _prompt_routing(model, prompt) -> np.ndarray:
    """The MoE layers' expert sets of a fresh forward of ``prompt`` alone, sorted: [positions, moe layers, topk]."""
    _, routing = _recompute(model, prompt[:-1], torch.tensor([prompt[-1], 0]))  # fed: all but the last output token
    return np.sort(routing.numpy(), -1)


@pytest.mark.e2e
def test_a_prompt_reuses_only_its_own_keys_kv_and_never_kv_from_before_an_update(models, shape, tmp_path):
    """SGLang's radix cache, partitioned by extra_key: a group's n completions share their prompt's prefill, a request
    of another key reuses nothing, and after an update that could not flush (an in_place pause) a request keyed to the
    new version gets its prompt's routing from a fresh forward under the new weights; the old key would still be served
    the old routing, which is why clients key requests by policy version."""
    p = len(LONG_PROMPT)
    group = {"max_new_tokens": 3, "ignore_eos": True, "n": 4, "sampling_seed": 1}
    one = {**group, "n": 1}

    async def go():
        async with EngineClient([url], shape) as client:
            ask = lambda params, key: client.generate(LONG_PROMPT, params, ROUTING, extra_key=key)  # noqa: E731
            first, again, elsewhere = await ask(group, "v0"), await ask(group, "v0"), await ask(one, "other")
            await client.pause("in_place")
            await client.update_weights_from_disk(str(models[1]), weight_version="v1", flush_cache=False)
            await client.resume()
            new, old_key = await ask(group, "v1"), await ask(one, "v0")
            await client.flush_cache()
            return first, again, elsewhere, new, old_key, await ask(one, "v0")

    with running_server(models[0], tmp_path) as url:
        first, again, elsewhere, new, old_key, flushed = run(go())
    assert [c.cached_tokens for c in first] == [0, p - 1, p - 1, p - 1]  # one prefill for the group
    assert [c.cached_tokens for c in again] == [p - 1] * 4
    assert elsewhere[0].cached_tokens == 0
    assert [c.cached_tokens for c in new] == [0, p - 1, p - 1, p - 1]
    assert old_key[0].cached_tokens == p - 1 and flushed[0].cached_tokens == 0
    old_weights = _prompt_routing(
        AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval(), LONG_PROMPT
    )
    new_weights = _prompt_routing(
        AutoModelForCausalLM.from_pretrained(models[1], dtype=torch.float32).eval(), LONG_PROMPT
    )
    # the two models route this prompt differently: the test can tell
    assert not np.array_equal(old_weights, new_weights)
    prompt_rows = lambda c: np.sort(c.routing[:p], -1)  # noqa: E731
    for c in [*first, *again, *elsewhere]:
        assert np.array_equal(prompt_rows(c), old_weights)
    for c in [*new, *flushed]:
        assert np.array_equal(prompt_rows(c), new_weights)
    assert np.array_equal(prompt_rows(old_key[0])[: p - 1], old_weights[: p - 1])  # served from before the update


@pytest.mark.e2e
def test_a_finished_completion_is_reused_by_the_prompt_that_extends_it(models, shape, tmp_path):
    """As SGLang's radix cache keeps a finished request's tokens, a next turn's prompt (the last prompt, its completion,
    more tokens) reuses their KV, routing included; an adapter's requests do not reuse the base model's."""
    params = {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 2}

    async def go():
        async with EngineClient([url], shape) as client:
            (turn,) = await client.generate(LONG_PROMPT, params, ROUTING, extra_key="k")
            follow = LONG_PROMPT + turn.output_ids.tolist() + [21, 22, 23]
            (next_turn,) = await client.generate(follow, params, ROUTING, extra_key="k")
            return turn, follow, next_turn

    with running_server(models[0], tmp_path) as url:
        turn, follow, next_turn = run(go())
    fed = len(LONG_PROMPT) + len(turn.output_ids) - 1  # the last output token was sampled, never fed
    assert next_turn.cached_tokens == fed
    assert np.array_equal(next_turn.routing[:fed], turn.routing)
    fresh = _prompt_routing(AutoModelForCausalLM.from_pretrained(models[0], dtype=torch.float32).eval(), follow)
    assert np.array_equal(np.sort(next_turn.routing[: len(follow)], -1), fresh)
