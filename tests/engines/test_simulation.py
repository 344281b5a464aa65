"""The simulated engine (``moerl serve --simulate``): the embedded engine's protocol tests that need no model, run
against it, and its lengths, payloads and timings following its profile."""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib.util
import math
import os
import shutil
import signal
import sys
import time
import types

import numpy as np
import pytest

from moerl.errors import ConfigError
from moerl.simulation import Profile
from tests import DATA, REPO
from tests.engine_server import running_server, serving, serving_app
from tests.engines.test_engine_control import (  # noqa: F401  the control tests, with this module's server
    test_abort_returns_the_partial_output,
    test_pause_holds_requests_until_continue,
    test_pause_with_abort_finishes_running_requests,
    test_retract_then_continue_gives_the_uninterrupted_output,
)
from tests.engines.test_engine_requests import (  # noqa: F401  the hostile-request tests, with this module's server
    PROMPT,
    hostile_models,
    reference,
    request,
    test_a_client_that_disconnects_has_its_requests_aborted,
    test_a_disk_update_from_anything_but_this_model_changes_nothing,
    test_a_flushing_update_during_an_in_place_pause_is_refused_untouched,
    test_a_join_to_a_refused_port_fails_fast_and_slow_joins_starve_nothing,
    test_a_tiny_temperature_is_greedy_and_the_answer_is_valid_json,
    test_abort_by_rid_aborts_all_n_completions,
    test_any_corrupted_body_on_any_route_is_refused_and_changes_nothing,
    test_malformed_bodies_get_a_json_400,
    test_wrong_methods_and_routes_answer_json,
    test_wrong_types_and_ranges_get_a_400_naming_the_field,
)

PROFILE = DATA / "simulation" / "tiny.yaml"
LAYERS, TOPK, VOCAB = 4, 2, 256  # the tiny model's


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = hostile_models(tmp_path_factory.mktemp("hostile"))
    made[0], made[1] = made["base"], made["other"]  # the control tests take the pair by index
    return made


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with running_server(models["base"], tmp_path_factory.mktemp("log"), "--simulate", str(PROFILE)) as url:
        yield url


def generate(url, body):
    status, answer, _ = request(url, "/generate", body)
    assert status == 200, answer
    return answer if isinstance(answer, list) else [answer]


@pytest.mark.e2e
def test_the_server_says_it_is_simulated_and_holds_no_weights(server):
    status, info, _ = request(server, "/server_info", method="GET")
    assert status == 200 and info["engine"] == "moerl-simulated" and info["dtype"] == "float32"
    status, answer, _ = request(server, "/get_weights_by_name", {"name": "model.norm.weight"})
    assert status == 400 and "holds no weights" in answer["error"]["message"]
    status, answer, _ = request(server, "/weights_checker", {})
    assert status == 400 and "holds no weights" in answer["error"]["message"]


@pytest.mark.e2e
def test_lengths_and_payloads_follow_the_profile(server):
    profile = Profile.load(PROFILE).engine
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"n": 200, "max_new_tokens": 400, "top_k": 5, "sampling_seed": 7},
        "return_logprob": True,
        "return_routed_experts": True,
        "return_sampling_mask": True,
    }
    completions = generate(server, body)
    lengths = np.array([len(c["output_ids"]) for c in completions])
    # Seeded: the same 200 draws every run. Their median is within sampling error (about 9% here) of the profile's.
    assert abs(np.median(lengths) / profile.response_tokens.median - 1) < 0.25, np.median(lengths)
    assert (lengths > profile.response_tokens.p99).mean() < 0.05
    for c in completions:
        meta, n = c["meta_info"], len(c["output_ids"])
        assert meta["finish_reason"]["type"] == ("stop" if n < 400 else "length")
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
        assert [tok for _, tok, _ in meta["output_token_logprobs"]] == c["output_ids"]
        assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
        routing = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, LAYERS, TOPK)
        assert routing.shape[0] == len(PROMPT) + n - 1  # every position fed: the prompt and the output but its last
        moe = routing[:, (routing >= 0).all(axis=(0, 2))]
        assert (
            moe.shape[1] > 0
            and (moe < 8).all()
            and all(len(set(row)) == TOPK for row in moe.reshape(-1, TOPK).tolist())
        )
        kept = meta["output_token_sampling_mask"]
        assert [len(k) for k in kept] == [5] * n
        assert all(tok in k and k == sorted(set(k)) for tok, k in zip(c["output_ids"], kept, strict=True))
        assert all(max(k) < VOCAB for k in kept)


@pytest.mark.e2e
def test_kept_sets_under_top_p_vary_in_size_and_their_log_probs_normalise(server):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {
            "n": 4,
            "max_new_tokens": 60,
            "top_k": 6,
            "top_p": 0.9,
            "sampling_seed": 3,
            "ignore_eos": True,
        },
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }
    sizes = []
    for c in generate(server, body):
        meta = c["meta_info"]
        for token, ids, logprobs in zip(
            c["output_ids"], meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"], strict=True
        ):
            assert token in ids and ids == sorted(set(ids)) and len(logprobs) == len(ids)
            assert abs(np.logaddexp.reduce(logprobs)) < 1e-9
            sizes.append(len(ids))
    assert min(sizes) >= 1 and max(sizes) <= 6 and len(set(sizes)) > 1


@pytest.mark.parametrize("top_p", [1.0, 0.9])
@pytest.mark.parametrize("mode", ["selected", "support"])
def test_kept_sets_answered_in_process_decode_as_their_json_does(models, top_p, mode):
    """The simulated engine keeps its kept sets as arrays, which the answer's JSON writes as lists: an answer served
    in-process decodes to what its JSON decodes to, with equal sets (top_p 1) or not."""
    import orjson

    from moerl.engines import protocol as P
    from moerl.engines.embedded.streaming import to_json
    from moerl.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(Profile.load(PROFILE), str(models["base"]), time_scale=20)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"n": 2, "max_new_tokens": 40, "top_k": 6, "top_p": top_p, "ignore_eos": True},
        "return_sampling_mask": True,
        "sampling_logprobs_mode": mode,
    }
    engine.scheduler.start()
    try:
        answers = engine.generate(body)
    finally:
        engine.scheduler.stop()
    for answer in answers:
        wire = orjson.loads(to_json(answer))
        kept = wire["meta_info"]["output_token_sampling_mask"]
        assert len(kept) == 40 and all(isinstance(k, list) and k == sorted(set(k)) for k in kept)
        assert (len({len(k) for k in kept}) > 1) == (top_p < 1)
        here, there = P.decode_generate(answer, None), P.decode_generate(wire, None)
        assert np.array_equal(here.mask_offsets, there.mask_offsets) and np.array_equal(here.mask_ids, there.mask_ids)
        if mode == "selected":
            assert here.sampling_logprobs is not None and np.array_equal(
                here.sampling_logprobs, there.sampling_logprobs
            )
        else:
            assert here.sampling_logprobs is None and there.sampling_logprobs is None


@pytest.mark.e2e
def test_a_response_takes_its_tokens_at_the_profiles_decode_rate(server):
    profile = Profile.load(PROFILE).engine
    body = {"input_ids": PROMPT, "sampling_params": {"n": 2, "max_new_tokens": 100, "ignore_eos": True}}
    start = time.monotonic()
    completions = generate(server, body)
    seconds = time.monotonic() - start
    assert [len(c["output_ids"]) for c in completions] == [100, 100]
    due = 100 / profile.decode_rate(2)  # two requests share the engine: 100 + 1500/63 tokens/s between them
    assert due * 0.95 <= seconds < 2 * due + 1.0, (seconds, due)


@pytest.mark.e2e
def test_an_in_place_update_splits_the_version_spans_where_it_happened(server, models):
    from moerl.engines.client import EngineClient

    async def go():
        async with EngineClient([server]) as client:
            body = {"max_new_tokens": 150, "ignore_eos": True, "sampling_seed": 3}
            task = asyncio.ensure_future(client.generate(PROMPT, body))
            await asyncio.sleep(0.5)  # about 50 tokens in, at 100 tokens/s
            await client.pause("in_place")
            await client.update_weights_from_disk(str(models["other"]), weight_version="v2", flush_cache=False)
            await client.resume()
            (completion,) = await task
            await client.set_weight_version("default")  # as the other tests expect to find it
            return completion

    completion = asyncio.run(go())
    spans = completion.weight_versions
    assert [s["version"] for s in spans] == ["default", "v2"], spans
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 150
    assert 20 <= spans[0]["end"] <= 100


@pytest.mark.e2e
def test_the_prefix_cache_is_the_embedded_engines_by_key_group_and_finished_turn(server):
    """As the embedded engine's (tests/engines/test_engine.py): n completions share one prefill, another key reuses
    nothing, a prompt extending a finished completion reuses what it fed, a flush drops it all."""
    prompt, p = list(range(40, 70)), 30
    group = {"n": 3, "max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 4}

    def ask(ids, key, params=group):
        return generate(server, {"input_ids": ids, "sampling_params": params, "extra_key": key})

    assert [c["meta_info"]["cached_tokens"] for c in ask(prompt, "sim-a")] == [0, p - 1, p - 1]
    assert [c["meta_info"]["cached_tokens"] for c in ask(prompt, "sim-b")] == [0, p - 1, p - 1]
    (turn,) = ask(prompt, "sim-a", {**group, "n": 1})
    follow = prompt + turn["output_ids"] + [7, 8]
    assert ask(follow, "sim-a", {**group, "n": 1})[0]["meta_info"]["cached_tokens"] == p + 5 - 1
    assert request(server, "/flush_cache")[0] == 200
    assert ask(prompt, "sim-a", {**group, "n": 1})[0]["meta_info"]["cached_tokens"] == 0


def test_a_client_gone_has_its_requests_aborted_and_no_answer_made_for_it(models):
    """The answers of requests aborted because their client left are never built: at true size, a stopping job's
    hundreds of them would cost the engines seconds of CPU and gigabytes for nobody."""
    import aiohttp

    from moerl.engines.embedded.server import build_app
    from moerl.engines.embedded.streaming import DISCONNECT_POLL_S
    from moerl.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(Profile.load(PROFILE), str(models["base"]))
    built = []
    real_response = engine.response
    engine.response = lambda r, req: built.append(r.rid) or real_response(r, req)
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"n": 8, "max_new_tokens": 500, "ignore_eos": True},
    }  # 15 s at the profile's rates

    async def leave() -> None:
        async with serving_app(build_app(engine)) as url:
            async with aiohttp.ClientSession() as gone:  # closed on leaving: the connection with it
                with pytest.raises(asyncio.TimeoutError):
                    await gone.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1.0))
            for _ in range(100):  # the handler notices within its poll interval
                await asyncio.sleep(DISCONNECT_POLL_S / 10)
                if not engine.scheduler.running:
                    break
            assert not engine.scheduler.running and not engine.scheduler.waiting  # all 8 aborted

    asyncio.run(leave())
    assert built == []


def test_a_completion_waiting_for_its_group_is_held_on_disk_alone(models, monkeypatch):
    """Past SPILL_BYTES a finished completion waits for the rest of its n (and its client) in a file and nowhere in
    memory: spilled by the request's handler, each one's bytes also stayed in the handler's frame until the next
    completion came, which at 32 trainer + 96 engine GPUs held half a GB in each process of four simulated replicas."""
    import gc

    import aiohttp

    from moerl.engines.embedded import streaming
    from moerl.engines.embedded.server import build_app
    from moerl.engines.simulated import SimulatedEngine

    engine = SimulatedEngine(Profile.load(PROFILE), str(models["base"]))
    monkeypatch.setattr(streaming, "SPILL_BYTES", 0)
    spilled, holders, checked = [], [], []
    real_spill, real_response = streaming._Spilled.__init__, engine.response

    def spill(self, data: bytes) -> None:
        spilled.append(data)
        real_spill(self, data)

    def response(r, req):  # on the scheduler's thread, as each completion finishes: the earlier ones wait on disk
        holders.extend(
            type(holder).__name__ for data in spilled for holder in gc.get_referrers(data) if holder is not spilled
        )
        checked.append(len(spilled))
        return real_response(r, req)

    monkeypatch.setattr(streaming._Spilled, "__init__", spill)
    engine.response = response
    n = 4
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"n": n, "max_new_tokens": 400, "sampling_seed": 3},
        "return_routed_experts": True,
    }

    async def ask() -> list:
        async with serving_app(build_app(engine)) as url, aiohttp.ClientSession() as session:
            async with session.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
                return await resp.json()

    answers = asyncio.run(ask())
    assert len(answers) == n and len(spilled) == n
    assert checked == list(range(n)) and holders == []


def with_routing_and_kept_sets(params):
    """A /generate request of :data:`PROMPT` sampled with ``params``, asking for routing from position 2 and kept sets,
    as the client asks it."""
    from moerl.engines import protocol as P

    return P.GenerateReqInput(
        input_ids=PROMPT,
        sampling_params=params,
        return_logprob=True,
        return_routed_experts=True,
        routed_experts_start_len=2,
        return_sampling_mask=True,
        sampling_logprobs_mode="selected",
    )


@pytest.mark.e2e
def test_generation_workers_carry_requests_as_the_client_would_and_lose_nothing_silently(server, models, monkeypatch):
    """Through the workers (HTTP and decoding in other processes) a generation gives what the client gives in its own
    process; a broken answer and an engine's refusal raise there as here; a killed worker's generations raise WorkerLost
    and leave the replica in rotation; a cancelled generation is aborted on the engine; a stuck worker is killed at the
    client's deadline; closing the client ends what its workers still carried."""
    import json

    from aiohttp import web

    from moerl.engines import client as client_module
    from moerl.engines import protocol as P
    from moerl.engines.client import EngineClient, EngineError, ReplicaDown, Returns
    from moerl.engines.generation_workers import WorkerLost
    from moerl.engines.health import State
    from moerl.models import model_shape
    from tests.engines.test_engine_requests import _request

    shape = model_shape(json.loads((models["base"] / "config.json").read_text()))
    params = P.SamplingParams(n=3, max_new_tokens=40, top_k=5, sampling_seed=1)
    long = {"n": 8, "max_new_tokens": 500, "ignore_eos": True}  # 15 s at the profile's rates: running until aborted

    async def broken(_):
        return web.Response(text='{"output_ids": [1, 2', content_type="application/json")  # cut off mid-answer

    answer = {}  # one answer of the simulated engine (its log-probs are random), given again to each client

    async def fixed(request):
        # n completions with kept sets come one a request (protocol.one_by_one): completion i to "<rid>-i"
        body = await request.json()
        if body["sampling_params"]["max_new_tokens"] == 0:  # the prompt's prefill
            return web.json_response({"output_ids": [], "meta_info": {}})
        completion = json.loads(answer["body"])[int(body["rid"].rsplit("-", 1)[1])]
        return web.json_response(completion)

    async def keep(body: bytes) -> bytes:
        return body

    async def generations(client):
        return await client.generate(PROMPT, params, Returns(routing_from=2, sampling_mask=True), rid="w")

    async def go():
        async with (
            serving({("POST", "/generate"): broken}) as bad,
            serving({("POST", "/generate"): fixed}) as same,
            EngineClient([same], shape=shape) as here,
            EngineClient([server, bad, same], shape=shape, workers=2) as there,
        ):
            request = with_routing_and_kept_sets(params)
            answer["body"] = await here._call(server, P.GENERATE, request, parse=keep)
            assert len(answer["body"]) <= P.largest_answer_bytes(request, shape) < client_module.CARRY_ELSEWHERE_BYTES
            await generations(there)
            assert not there.worker_pids(), "an answer that cannot reach the threshold went to a worker"
            monkeypatch.setattr(client_module, "CARRY_ELSEWHERE_BYTES", 0)  # the tiny model's answers are far below it
            there.in_flight.update({server: 1_000, bad: 1_000})  # to the replica that gives the answer again
            mine, theirs = await generations(here), await generations(there)
            there.in_flight.update({server: 0, same: 1_000})
            assert len(there.worker_pids()) == 2
            with pytest.raises(EngineError, match=r"refused \(400\).*vocabulary") as refused:
                await there.generate([1, 999_999], {"max_new_tokens": 4})
            assert refused.value.status == 400 and there.health.state(server) is State.HEALTHY

            running = asyncio.ensure_future(there.generate(PROMPT, long))
            await asyncio.sleep(0.5)
            for pid in there.worker_pids():  # killed for memory, say
                os.kill(pid, signal.SIGKILL)
            with pytest.raises(WorkerLost, match="generation worker carrying it died"):
                await running
            assert there.health.state(server) is State.HEALTHY  # the replica did nothing wrong
            again = await generations(there)  # new workers
            await asyncio.sleep(3.0)  # the engine notices the lost connection within its poll interval
            assert (await _request(server, "/abort_request", {"abort_all": True}))[1]["aborted"] == 0

            cancelled = asyncio.ensure_future(there.generate(PROMPT, long))
            await asyncio.sleep(0.5)
            cancelled.cancel()
            await asyncio.sleep(3.0)
            assert (await _request(server, "/abort_request", {"abort_all": True}))[1]["aborted"] == 0

            there.in_flight.update({server: 1_000, bad: 0})  # the next generation goes to the broken replica
            with pytest.raises(ReplicaDown, match="not JSON"):
                await there.generate(PROMPT, {"max_new_tokens": 4}, Returns(routing_from=0))

            async with EngineClient([server], shape=shape, workers=1) as stuck:
                await stuck.generate(PROMPT, {"max_new_tokens": 2})  # its worker started and serving
                stuck.workers.deadline_s = (
                    2.0  # in place of the client's 600 s and the grace: one this test can wait for
                )
                running = asyncio.ensure_future(stuck.generate(PROMPT, long))
                await asyncio.sleep(0.5)
                (pid,) = stuck.worker_pids()
                os.kill(pid, signal.SIGSTOP)  # neither answers nor dies
                with pytest.raises(WorkerLost, match="no answer in 2 s; killed"):
                    await running
                stuck.workers.deadline_s = 600.0  # a new worker takes longer than 2 s to start
                await stuck.generate(PROMPT, {"max_new_tokens": 2})  # and serves
                running = asyncio.ensure_future(stuck.generate(PROMPT, long))
                await asyncio.sleep(0.5)
            with pytest.raises(WorkerLost, match="the client closed"):
                await running
            await asyncio.sleep(3.0)  # the closed workers' connections closed with them: nothing runs for them
            assert (await _request(server, "/abort_request", {"abort_all": True}))[1]["aborted"] == 0
            return mine, theirs, again, there.health.state(bad)

    mine, theirs, again, state = asyncio.run(go())
    assert len(mine) == len(theirs) == 3
    for a, b, c in zip(mine, theirs, again, strict=True):
        assert a.routing is not None and a.mask_ids is not None and a.routing_start == 2
        for name in ("rid", "prompt_len", "finish_reason", "weight_versions", "routing_start"):
            assert getattr(a, name) == getattr(b, name), name
        for name in ("output_ids", "logprobs", "routing", "mask_offsets", "mask_ids", "sampling_logprobs"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
        # seeded: the same again
        assert np.array_equal(a.output_ids, c.output_ids) and np.array_equal(a.routing, c.routing)
    assert state is not State.HEALTHY


@pytest.mark.e2e
def test_a_client_has_every_generation_it_carries_on_its_engine_at_once(server, models, monkeypatch):
    """A group's completions with kept sets go one a request (protocol.one_by_one): 150 of them, sent by the client
    itself and through a generation worker, are all on the engine at once. None waits in the client for another's
    connection (aiohttp's pool holds 100 unless told otherwise) while its caller counts it as running."""
    import json

    from aiohttp import web

    from moerl.engines import client as client_module
    from moerl.engines import protocol as P
    from moerl.engines.client import EngineClient, Returns
    from moerl.models import model_shape

    n = 150
    shape = model_shape(json.loads((models["base"] / "config.json").read_text()))
    params = P.SamplingParams(n=n, max_new_tokens=40, top_k=5, sampling_seed=1)
    returns = Returns(routing_from=2, sampling_mask=True)
    held: dict = {"arrived": 0}

    async def hold(request):
        """Answers no completion before all ``n`` of the group are here."""
        body = await request.json()
        if body["sampling_params"]["max_new_tokens"] == 0:  # the prompt's prefill
            return web.json_response({"output_ids": [], "meta_info": {}})
        held["arrived"] += 1
        if held["arrived"] == n:
            held["everyone"].set()
        await held["everyone"].wait()
        return web.Response(body=held["answer"], content_type="application/json")

    async def keep(body: bytes) -> bytes:
        return body

    async def go() -> list[tuple[int, int]]:
        seen = []
        async with serving({("POST", "/generate"): hold}) as url, EngineClient([server], shape=shape) as recorder:
            one = with_routing_and_kept_sets(params.model_copy(update={"n": 1}))
            held["answer"] = await recorder._call(server, P.GENERATE, one, parse=keep)
            for workers in (0, 1):
                if workers:
                    monkeypatch.setattr(client_module, "CARRY_ELSEWHERE_BYTES", 0)  # the tiny model's answers are small
                held.update(arrived=0, everyone=asyncio.Event())
                async with EngineClient([url], shape=shape, workers=workers) as client:
                    try:
                        completions = await asyncio.wait_for(client.generate(PROMPT, params, returns), 60)
                    except TimeoutError:
                        completions = []
                    seen.append((held["arrived"], len(completions)))
                    assert bool(client.worker_pids()) == bool(workers), "the group went where it was meant to"
        return seen

    assert asyncio.run(go()) == [(n, n), (n, n)]


# ---- continuations and siblings ----------------------------------------------------------------------------------
STOP = 1  # the replicas' end token below


@pytest.fixture
def replicas():
    """Two simulated replicas' schedulers (no HTTP), time run so fast that a request is answered at once."""
    from moerl.engines.simulated import SimulatedScheduler

    made = [SimulatedScheduler(Profile.load(PROFILE).engine, 1e6, VOCAB, None, {STOP}, 4096) for _ in range(2)]
    for scheduler in made:
        scheduler.start()
    yield made
    for scheduler in made:
        scheduler.stop()


def decode(scheduler, ids: list[int], max_new_tokens: int, seed: int | None, top_k: int = 16) -> tuple[list[int], str]:
    """One request on ``scheduler``: its output ids and finish reason."""
    import threading

    from moerl.engines.protocol import SamplingParams
    from moerl.engines.simulated import SimulatedRequest

    done = threading.Event()
    params = SamplingParams(max_new_tokens=max_new_tokens, sampling_seed=seed, top_k=top_k)
    request = SimulatedRequest("r", list(ids), params, on_update=lambda request, finished: finished and done.set())
    scheduler.submit(request)
    assert done.wait(10)
    return request.output_ids, request.finish_reason["type"]


def chunked(replicas, ids: list[int], budget: int, chunks: list[int], seed: int | None, top_k: int = 16):
    """The request cut as the rollout manager cuts it: each chunk (the last, what is left of ``budget``) asked on the
    next replica in turn, from the prompt and the output so far. The whole output and each piece's finish reason."""
    output: list[int] = []
    reasons: list[str] = []
    for i, size in enumerate([*chunks, budget - sum(chunks)]):
        piece, reason = decode(replicas[i % len(replicas)], ids + output, size, seed, top_k)
        output += piece
        reasons.append(reason)
        if reason == "stop":
            break
    return output, reasons


def test_a_request_cut_into_chunks_on_other_replicas_is_the_uncut_request(replicas):
    """Where it stops, its ids and its finish reasons: length at a cut while the sample goes on, stop at its end,
    length at the overall cap."""
    prompt, checked = list(range(50, 80)), 0
    for seed in range(40):
        whole, reason = decode(replicas[0], prompt, 1000, seed)
        n = len(whole)
        assert reason == "stop" and whole[-1] == STOP
        if n < 6:
            continue
        for chunks in ([n // 2], [1], [n - 1], [3, 2], [n // 3, n // 3 + 1], [1, n - 2]):
            output, reasons = chunked(replicas, prompt, 1000, chunks, seed)
            assert output == whole and reasons == ["length"] * len(chunks) + ["stop"], (seed, chunks)
        # a first chunk that ends where the sample stops: stop there
        assert chunked(replicas, prompt, 1000, [n], seed) == (whole, ["stop"])
        # the overall cap before the sample's end: length there, cut or not
        assert decode(replicas[1], prompt, n - 1, seed) == (whole[:-1], "length")
        assert chunked(replicas, prompt, n - 1, [2, n // 2], seed) == (whole[:-1], ["length"] * 3)
        checked += 1
    assert checked > 20
    # greedy: continued under the same weights, the same
    whole, _ = decode(replicas[0], prompt, 1000, None, top_k=1)
    assert chunked(replicas, prompt, 1000, [len(whole) // 2], None, top_k=1) == (whole, ["length", "stop"])
    # A seed's tokens differ by prompt position, not by prompt: continuations are told apart by their seed.
    assert decode(replicas[0], prompt, 1000, 1)[0] != decode(replicas[0], prompt, 1000, 2)[0]


@pytest.mark.parametrize("rho, low, high", [(0.0, -0.3, 0.3), (0.9, 0.7, 1.0)])
def test_a_prompts_siblings_lengths_follow_the_profiles_correlation(rho, low, high):
    """24 prompts' 8 completions each (their seeds as an n=8 request's), as the engine plans them. The bounds are
    over 7 of the estimator's standard errors (about 0.04) from the correlation."""
    from moerl.engines.protocol import SamplingParams
    from moerl.engines.simulated import SimulatedRequest, SimulatedScheduler
    from moerl.simulation import ResponseLengths

    engine = Profile.load(PROFILE).engine
    engine.response_tokens = ResponseLengths(median=40, p99=200, correlation=rho)
    scheduler = SimulatedScheduler(engine, 1.0, VOCAB, None, {STOP}, 1 << 20)
    rng = np.random.default_rng(5)
    logs = []
    for prompt in rng.integers(2, VOCAB, (24, 30)).tolist():
        row = []
        for k in range(8):
            request = SimulatedRequest("r", prompt, SamplingParams(max_new_tokens=1 << 19, sampling_seed=1000 + k))
            scheduler._plan(request)
            row.append(np.log(request.target))
        logs.append(row)
    logs = np.array(logs)
    between, within = 8 * logs.mean(axis=1).var(ddof=1), logs.var(axis=1, ddof=1).mean()
    icc = (between - within) / (between + 7 * within)
    assert low < icc < high, icc


@pytest.mark.e2e
def test_a_continuation_on_another_replica_process_gives_the_uncut_output_and_its_own_versions(server, models):
    """Over HTTP, one replica in this process and the module's in another: the pieces make the uncut completion, each
    piece's weight versions cover its own output from 0."""
    from moerl.engines.embedded.server import build_app
    from moerl.engines.simulated import SimulatedEngine
    from tests.engines.test_engine_requests import _request

    profile = Profile.load(PROFILE)
    engine = SimulatedEngine(profile, str(models["base"]), time_scale=20)
    seed = next(s for s in range(1000) if 30 <= math.ceil(profile.engine.response_tokens.tokens(PROMPT, s)) <= 80)

    async def ask(url, ids, max_new_tokens):
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": seed}}
        status, answer, _ = await _request(url, "/generate", body)
        assert status == 200, answer
        meta = answer["meta_info"]
        assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(answer["output_ids"])}]
        return answer["output_ids"], meta["finish_reason"]["type"]

    async def go():
        async with serving_app(build_app(engine)) as here:
            whole, reason = await ask(here, PROMPT, 400)
            pieces = []
            for url, size in ((here, 11), (server, 7), (here, 400 - 18)):
                piece = await ask(url, PROMPT + [t for p, _ in pieces for t in p], size)
                pieces.append(piece)
            return whole, reason, pieces

    whole, reason, pieces = asyncio.run(go())  # (the app's cleanup stops its engine)
    assert len(whole) == math.ceil(profile.engine.response_tokens.tokens(PROMPT, seed)) and reason == "stop"
    assert [t for p, _ in pieces for t in p] == whole
    assert [r for _, r in pieces] == ["length", "length", "stop"]


def test_a_simulated_engines_prefix_cache_is_its_profiles_unless_given(models, tmp_path):
    """A profile may size its replicas' prefix cache (the KV memory beside the weights): a continuation asked at once
    then finds its prefix as on a GPU, where the embedded engine's CPU default would have evicted it."""
    from moerl.engines.embedded.scheduler import DEFAULT_PREFIX_CACHE_TOKENS
    from moerl.engines.simulated import SimulatedEngine

    sized = tmp_path / "sized.yaml"
    sized.write_text(
        PROFILE.read_text().replace("  prefill_tokens_per_s:", "  prefix_cache_tokens: 123456\n  prefill_tokens_per_s:")
    )
    for path, given, held in ((PROFILE, None, DEFAULT_PREFIX_CACHE_TOKENS), (sized, None, 123456), (sized, 0, 0)):
        engine = SimulatedEngine(Profile.load(path), str(models["base"]), prefix_cache_tokens=given)
        assert engine.scheduler.prefix_cache.capacity == held, (path.name, given)
    bad = tmp_path / "bad.yaml"
    bad.write_text(sized.read_text().replace("prefix_cache_tokens: 123456", "prefix_cache_tokens: -1"))
    with pytest.raises(ConfigError, match="engine.prefix_cache_tokens"):
        Profile.load(bad)


def test_a_checkpoints_headers_are_checked_once_for_all_replicas_of_a_process(models, tmp_path, monkeypatch):
    """A disk update's header check is of the directory, not of each replica: at true size each took a second of the
    process's CPU in turn. A directory written again is checked again, and one that is not the model is refused by
    every replica."""
    from moerl.checkpoint.hf import CheckpointError
    from moerl.engines.embedded import engine as embedded
    from moerl.engines.simulated import SimulatedEngine

    checks = []
    real_check = embedded.check_hf_tensors
    monkeypatch.setattr(embedded, "check_hf_tensors", lambda *args: checks.append(1) or real_check(*args))
    replicas = [SimulatedEngine(Profile.load(PROFILE), str(models["base"])) for _ in range(3)]
    expected = sorted(replicas[0].family.hub_shapes(replicas[0].hub_config).items())
    update, weights = tmp_path / "v1", "model.safetensors"
    shutil.copytree(models["base"], update)

    def write(source):  # as the trainer does: a whole new file in its place
        shutil.copy(source / weights, tmp_path / weights)
        os.replace(tmp_path / weights, update / weights)

    def read_all():
        for replica in replicas:
            named = replica.read_model_dir(str(update))
            assert sorted((name, tuple(t.shape)) for name, t in named) == expected
            assert {t.device.type for _, t in named} == {"meta"}

    read_all()
    assert len(checks) == 1
    write(models["bigger-vocab"])
    for replica in replicas:
        with pytest.raises(CheckpointError, match="wrong shapes"):
            replica.read_model_dir(str(update))
    assert len(checks) == 4  # a refusal is not remembered
    write(models["other"])
    read_all()
    assert len(checks) == 5


def test_a_bad_profile_is_one_error_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        PROFILE.read_text()
        .replace("prefill_tokens_per_s: 20000", "prefill_tokens_per_s: -1")
        .replace("p99: 200", "p99: 20")
    )
    with pytest.raises(ConfigError) as err:
        Profile.load(bad)
    assert "engine.prefill_tokens_per_s" in str(err.value) and "engine.response_tokens" in str(err.value)


@pytest.mark.parametrize("path", sorted((REPO / "bench" / "profiles").glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_profiles_load_with_a_trainer_and_per_request_rates_that_fall_with_load(path):
    profile = Profile.load(path)
    engine = profile.engine
    rates = [engine.decode_rate(c) for c in range(1, engine.max_running_requests + 1)]
    assert profile.trainer is not None and rates == sorted(rates, reverse=True)


def bench_script(name: str) -> types.ModuleType:
    """``bench/<name>.py``, imported as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look up their module
    spec.loader.exec_module(module)
    return module


def test_the_async_guide_is_the_full_engines_without_a_tail_and_is_held_by_the_tail_with_one():
    bench = bench_script("simulation")
    profile = Profile.load(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml")
    engine, pool, samples, tokens = profile.engine, (32, 96), 768, 768 * 7000
    steps = [bench.step_times(profile, pool, samples, 7000, 30000, 61e9, 1536, 2)]
    sync, train = steps[0]["T_sync"], steps[0]["T_train"]
    full = engine.max_running_requests
    untailed, _ = bench.one_concurrency_guide(profile, pool, samples, tokens, 0, steps, 2)
    assert untailed == pytest.approx(samples / (sync + max(tokens / (48 * engine.decode_rate(full) * full), train)))
    tailed, at = bench.one_concurrency_guide(profile, pool, samples, tokens, 30000, steps, 2)
    assert tailed < min(untailed, samples / (sync + max(train, 30000 / (3 * engine.decode_rate(1)))))
    assert at < 1536 // 48  # fewer requests than the depth gives each replica, so that the tail decodes faster


def test_the_length_schedule_page_shows_the_sweeps_results_file():
    """The sweep of bench/length_schedule.py is run in parts and its runs kept in bench/results: its page shows the
    table the script makes from that file, so the page's figures are the file's."""
    bench = bench_script("length_schedule")
    results = bench.load_results(REPO / "bench" / "results" / "length_schedule.json")
    runs = bench.shown(results, argparse.Namespace(pools=None, correlations=None, modes=None, policies=None))
    assert runs and all(run["code"] for run in runs)
    page = (REPO / "docs" / "benchmarks" / "length-schedule.md").read_text()
    assert "\n".join(bench.table(runs)) in page


def test_a_length_schedule_run_is_keyed_by_its_profiles_contents(tmp_path):
    """A profile edited in place is a new configuration: the sweep does not skip its runs as done."""
    bench = bench_script("length_schedule")
    profile = tmp_path / "profile.yaml"
    job = argparse.Namespace(**{**dict.fromkeys(bench.SHAPE_KEYS, 1), "config": str(tmp_path / "job.yaml")})
    profile.write_text("engine: {prefix_cache_tokens: 32768}\n")
    before = bench.shape_of(job, profile, [])
    assert bench.shape_of(job, profile, []) == before
    profile.write_text("engine: {prefix_cache_tokens: 810000}\n")
    after = bench.shape_of(job, profile, [])
    assert after["profile"] == before["profile"] and after != before
    assert not bench.same_run({"shape": before}, {"shape": after})


def test_the_schedule_model_replays_a_runs_recorded_groups_step_by_step(tmp_path):
    """``--lengths``: the model's step k trains the run's k-th B groups (recorded as they finished, in any order), and a
    record it cannot replay in place (a gap, another shape) or too few groups is one error naming it."""
    from moerl.simulation import LENGTHS_FILE, LengthRecord

    bench = bench_script("schedule_model")
    profile = Profile.load(REPO / "bench" / "profiles" / "qwen3_30b_a3b_h100.yaml")
    shape = bench.Shape(8, 24, groups=4, samples=2, staleness=2, max_new_tokens=32768, model_gb=61.1, mode="sync")
    rng = np.random.default_rng(0)
    drawn = rng.integers(100, 30000, size=(8, 2))
    lines = [LengthRecord(int(g), drawn[g].tolist(), [False, False], 32768).line() for g in rng.permutation(8)]
    (tmp_path / LENGTHS_FILE).write_text("\n".join(lines) + "\n")

    recorded = bench.replayed_groups(tmp_path, shape)
    for name in ("groups", "length_aware"):
        steps = bench.AsyncLoop(profile, shape, bench.Policy(name), seed=0, recorded=recorded).run(2)
        for k, step in enumerate(steps):
            assert step["rollout/response_len_max"] == drawn[4 * k : 4 * k + 4].max()
            assert step["rollout/response_len_mean"] == pytest.approx(drawn[4 * k : 4 * k + 4].mean())
    with pytest.raises(SystemExit, match="the run recorded 8 groups and the model issues more"):
        bench.AsyncLoop(profile, shape, bench.Policy("groups"), seed=0, recorded=recorded).run(3)

    (tmp_path / LENGTHS_FILE).write_text("\n".join(line for line in lines if '"group":5,' not in line) + "\n")
    with pytest.raises(SystemExit, match="has no group 5 \\(next: 6\\)"):
        bench.replayed_groups(tmp_path, shape)
    with pytest.raises(SystemExit, match="--samples 3"):
        bench.replayed_groups(tmp_path, bench.Shape(8, 24, 4, 3, 2, 32768, 61.1, "sync"))
