"""The length-aware schedule (moerl.orchestrator.scheduling): the order the dispatcher starts requests in and the
replica each goes to, on hand-made groups; and a completion cut into chunks, each on another replica of the embedded
engine, equal to the same completion decoded in one request: its tokens, log-probs, kept sets, routing rows and
versions."""

from __future__ import annotations

import asyncio
import itertools
import json

import numpy as np
import pytest

from moerl.orchestrator.config import ScheduleSection, load_config
from moerl.orchestrator.scheduling import RECENT, TYPICAL_AFTER, Dispatcher, GroupLengths, Request

MAX_NEW = 1000


def schedule(**fields) -> ScheduleSection:
    return ScheduleSection(policy="length_aware", **fields)


def started_order(requests: list[Request], lengths: GroupLengths) -> list[tuple[int, bool, int]]:
    """The order in which one replica that runs one request at a time starts ``requests`` (all waiting at once)."""
    started: list[tuple[int, bool, int]] = []

    async def go():
        d = Dispatcher(lambda: ["a"], lengths, schedule(max_running=1))
        gate = asyncio.Event()

        async def occupy():  # holds the replica while the others queue up
            async with d.slot(Request(-1, probe=False)):
                await gate.wait()

        async def one(request: Request):
            async with d.slot(request):
                started.append((request.group, request.probe, request.decoded))
                await asyncio.sleep(0)

        first = asyncio.create_task(occupy())
        await asyncio.sleep(0)
        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            await asyncio.sleep(0)  # each begins waiting in this order
        gate.set()
        await asyncio.gather(first, *tasks)

    asyncio.run(go())
    return started


def test_continuations_then_probes_then_the_longest_predicted_group_first():
    lengths = GroupLengths(MAX_NEW)
    lengths.add(1, 50)
    lengths.add(1, 300)  # group 1: its longest finished, 300
    lengths.add(2, 700)
    lengths.add(3, 20)
    requests = [
        Request(3, probe=False),
        Request(1, probe=False),
        Request(4, probe=True),
        Request(2, probe=False),
        Request(5, probe=False),  # none of its group finished: predicted to run to max_new_tokens
        Request(3, probe=False, decoded=64),  # a continuation
        Request(6, probe=True),
        Request(1, probe=False, decoded=32),
    ]
    assert started_order(requests, lengths) == [
        (3, False, 64),  # continuations, oldest first
        (1, False, 32),
        (4, True, 0),  # probes, oldest first
        (6, True, 0),
        (5, False, 0),  # the rest, longest predicted first: 1000, 700, 300, 20
        (2, False, 0),
        (1, False, 0),
        (3, False, 0),
    ]


def test_a_group_predicted_longer_since_a_sibling_finished_overtakes_those_queued_before_it():
    lengths = GroupLengths(MAX_NEW)
    lengths.add(1, 100)
    lengths.add(2, 200)
    requests = [Request(2, probe=False), Request(1, probe=False)]
    assert started_order(requests, lengths) == [(2, False, 0), (1, False, 0)]
    lengths.add(1, 900)  # another of group 1 finished, longer
    assert started_order(requests, lengths) == [(1, False, 0), (2, False, 0)]


def test_each_request_goes_to_the_replica_with_the_fewest_predicted_tokens_left():
    lengths = GroupLengths(MAX_NEW)
    lengths.add(1, 800)
    lengths.add(2, 100)
    placed: list[str] = []

    async def go():
        d = Dispatcher(lambda: ["a", "b", "c"], lengths, schedule(chunk_tokens=500))
        hold = asyncio.Event()

        async def run(request: Request):
            async with d.slot(request) as url:
                placed.append(url)
                await hold.wait()

        tasks = []
        # group 1 predicts 800 tokens (a chunk of 500 at most), group 2 predicts 100
        for request in [Request(1, probe=False), Request(2, probe=False), Request(2, probe=False)]:
            tasks.append(asyncio.create_task(run(request)))
            await asyncio.sleep(0)
        assert placed == ["a", "b", "c"] and [d.load(u) for u in "abc"] == [500, 100, 100]
        # the next short one goes beside a short one, not beside the long one; a tie between them goes to the first
        for request in [Request(2, probe=False), Request(2, probe=False), Request(2, probe=False)]:
            tasks.append(asyncio.create_task(run(request)))
            await asyncio.sleep(0)
        assert placed[3:] == ["b", "c", "b"] and [d.load(u) for u in "abc"] == [500, 300, 200]
        # a continuation of group 1 (700 decoded, 100 predicted left) stays on its last replica where loads tie
        continuation = Request(1, probe=False, decoded=700, last="c")
        d.running["c"].append(Request(2, probe=False, predicted_left=100))
        tasks.append(asyncio.create_task(run(continuation)))
        await asyncio.sleep(0)
        assert placed[-1] == "c" and continuation.predicted_left == 100
        hold.set()
        await asyncio.gather(*tasks)
        assert d.running == {"a": [], "b": [], "c": [d.running["c"][0]]}

    asyncio.run(go())


def test_a_group_with_none_finished_is_predicted_the_median_of_the_last_finished_once_there_are_enough():
    lengths = GroupLengths(MAX_NEW)
    for k in range(TYPICAL_AFTER - 1):
        lengths.add(100 + k, 10 * (k + 1))
    assert lengths.predicted(1) == MAX_NEW  # too few finished to stand for a group
    lengths.add(200, 5)
    assert lengths.predicted(1) == 150  # the median (low) of 5, 10, ..., 310
    lengths.add(1, 40)
    assert lengths.predicted(1) == 40  # its own finished completion, once it has one
    for _ in range(RECENT):
        lengths.add(300, 7)
    assert lengths.predicted(2) == 7  # only the last RECENT count


def test_tail_requests_go_where_fewest_run_keep_their_replica_light_and_are_not_cut():
    """Requests predicted to run tail_tokens in all (their group's prediction, or twice what they decoded) go to the
    replica running the fewest; a replica running one takes others only while it runs fewer than tail_running. They
    are asked for the rest of their completion, the others for at most chunk_tokens (their predicted load the same)."""
    lengths = GroupLengths(MAX_NEW)
    lengths.add(1, 900)  # group 1 predicted 900: a tail
    lengths.add(2, 100)  # group 2 predicted 100
    lengths.add(3, 500)  # group 3 predicted 500
    placed: list[tuple[str, bool]] = []
    asked: list[tuple[int, float]] = []

    async def go():
        chunks = schedule(max_running=4, chunk_tokens=300, tail_tokens=800, tail_running=3)
        d = Dispatcher(lambda: ["a", "b"], lengths, chunks)
        hold = asyncio.Event()
        tasks: list[asyncio.Task] = []

        async def run(request: Request):
            tokens = d.asked(request, MAX_NEW - request.decoded)
            async with d.slot(request) as url:
                placed.append((url, request.tail))
                asked.append((tokens, request.predicted_left))
                await hold.wait()

        async def add(*requests: Request):
            for request in requests:
                tasks.append(asyncio.create_task(run(request)))
                await asyncio.sleep(0)

        await add(Request(3, probe=False), Request(2, probe=False), Request(2, probe=False))
        assert placed == [("a", False), ("b", False), ("b", False)]  # the fewest predicted tokens left
        assert asked == [(300, 300), (300, 100), (300, 100)]  # a chunk at most, as its predicted load
        # the tail request goes where fewest run ("a": one, of at most 300 tokens left, against two of 100), uncut
        await add(Request(1, probe=False))
        assert placed[3] == ("a", True) and asked[3] == (MAX_NEW, 900)
        # a continuation that decoded 450 of a group predicted 100 is a tail request too (2 x 450 >= 800); where as
        # many run on each replica, it stays on its last, asked for the rest of its completion
        await add(Request(2, probe=False, decoded=450, last="b"))
        assert placed[4] == ("b", True) and asked[4][0] == MAX_NEW - 450
        # "a" runs two with a tail, "b" three: the next short request goes to "a", the one after waits (both replicas
        # run a tail and tail_running requests), though max_running would let each run four
        await add(Request(2, probe=False), Request(2, probe=False))
        assert placed[5:] == [("a", False)] and len(d.waiting) == 1
        hold.set()
        await asyncio.gather(*tasks)
        assert len(placed) == 7 and not d.waiting and not any(d.running.values())

    asyncio.run(go())


def test_a_group_with_nothing_finished_yet_is_not_taken_for_a_tail():
    """Before enough completions have finished to stand for a group, its requests are ordered as if predicted
    max_new_tokens, but that placeholder makes none of them a tail request; what they decode still may."""
    lengths = GroupLengths(MAX_NEW)
    d = Dispatcher(lambda: ["a"], lengths, schedule(tail_tokens=800))
    fresh, past_half = Request(1, probe=True), Request(1, probe=False, decoded=400)
    assert lengths.predicted(1) == MAX_NEW and d.predicted_total(fresh) == 0 and d.predicted_total(past_half) == 800
    for k in range(TYPICAL_AFTER):
        lengths.add(100 + k, 900)
    assert d.predicted_total(fresh) == 900  # the typical completion's, once enough have finished
    lengths.add(1, 50)
    assert d.predicted_total(fresh) == 50 and d.predicted_total(past_half) == 800


def test_a_request_cancelled_while_it_waits_frees_nothing_it_did_not_hold():
    lengths = GroupLengths(MAX_NEW)

    async def go():
        d = Dispatcher(lambda: ["a"], lengths, schedule(max_running=1))
        entered = asyncio.Event()
        release = asyncio.Event()

        async def run(request: Request, done: list):
            async with d.slot(request):
                entered.set()
                await release.wait()
                done.append(request.group)

        done: list[int] = []
        first = asyncio.create_task(run(Request(1, probe=False), done))
        await entered.wait()
        waiting = asyncio.create_task(run(Request(2, probe=False), done))
        await asyncio.sleep(0)
        assert len(d.waiting) == 1
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not d.waiting and len(d.running["a"]) == 1
        third = asyncio.create_task(run(Request(3, probe=False), done))
        release.set()
        await asyncio.gather(first, third)
        assert done == [1, 3] and d.running["a"] == []

    asyncio.run(go())


def test_the_length_aware_schedule_is_checked():
    from moerl.errors import ConfigError

    load_config(None, ["rollout.schedule.policy=length_aware", "rollout.schedule.chunk_tokens=4"])
    for overrides, said in [
        (["rollout.schedule.probes=8"], "probes must be in [0, samples_per_prompt=8)"),
        (["rollout.schedule.tail_tokens=-1"], "tail_tokens >= 0"),
        (["rollout.schedule.tail_running=0"], "tail_running must be >= 1"),
        (["rollout.schedule.chunk_tokens=4", "rollout.partial=retry"], "rollout.partial=retry forbids"),
        (["rollout.schedule.chunk_tokens=4", "lora.enabled=true"], "set chunk_tokens=0"),
        (["rollout.agent=tests.episodes.agents:calculator_agent"], "single-turn groups"),
        (["rollout.schedule.policy=fifo"], "rollout.schedule.policy"),
    ]:
        with pytest.raises(ConfigError, match="rollout.schedule") as raised:
            load_config(None, ["rollout.schedule.policy=length_aware", *overrides])
        assert said in str(raised.value)


@pytest.mark.e2e
def test_a_completion_cut_into_chunks_on_alternate_replicas_equals_it_decoded_at_once(tmp_path):
    """Each completion of a group asked in chunks of 5 tokens, each chunk on the other of two embedded engines, equals
    the same completion of the group's single request: tokens, log-probs, kept sets, routing rows (the prompt's and
    every output position's, layer by layer) and versions. Then a weight version set between two chunks: the tokens
    before it carry the old version, those after the new."""
    from moerl.engines.client import EngineClient
    from moerl.models import model_shape
    from moerl.models.tiny import save_tiny_hf
    from moerl.orchestrator.generation import Tries
    from moerl.orchestrator.groups import SampleRequests
    from tests.engine_server import running_servers
    from tests.rollout_manager import chunked_generation

    model = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "model")
    shape = model_shape(json.loads((model / "config.json").read_text()))
    new_tokens, chunk = 23, 5

    async def go(urls: list[str]):
        async with EngineClient(urls, shape=shape, workers=0) as client:
            generation = chunked_generation(client, new_tokens, chunk, 4)
            prompt = [3, 17, 42, 99, 7, 11]
            whole, _ = await generation(0, prompt, Tries(), generation.params(0, 4), affinity="one replica")
            turns = itertools.cycle(urls)
            dispatcher = Dispatcher(lambda: [next(turns)], GroupLengths(new_tokens), generation.r.schedule)
            agent = SampleRequests(generation, None, dispatcher)
            chunked = [await agent._completion(0, prompt, k, Tries()) for k in range(4)]
            lengths = [len(c.output_ids) for c in whole]
            assert max(lengths) > 2 * chunk, f"too short to cut more than twice: {lengths}"
            for one, (cut, _) in zip(whole, chunked, strict=True):
                np.testing.assert_array_equal(cut.output_ids, one.output_ids)
                np.testing.assert_allclose(cut.logprobs, one.logprobs, atol=1e-5)
                np.testing.assert_allclose(cut.sampling_logprobs, one.sampling_logprobs, atol=1e-5)
                np.testing.assert_array_equal(cut.mask_offsets, one.mask_offsets)
                np.testing.assert_array_equal(cut.mask_ids, one.mask_ids)
                assert cut.routing.shape == (len(prompt) + len(one.output_ids) - 1, *shape_of(shape))
                np.testing.assert_array_equal(cut.routing, one.routing)
                assert cut.weight_versions == one.weight_versions and cut.finish_reason == one.finish_reason

            # a version set between the first chunk and the second, as a sync in place would
            first = await generation(
                1, prompt, Tries(), generation.params(1, 1).model_copy(update={"max_new_tokens": chunk})
            )
            await client.set_weight_version("2")
            client.health.sync_reached("2", urls)
            ids = prompt + first[0][0].output_ids.tolist()
            rest = await generation(
                1,
                ids,
                Tries(),
                generation.params(1, 1).model_copy(update={"max_new_tokens": new_tokens - chunk}),
                routing_start=len(ids) - 1,
            )
            joined = first[0][0].then(rest[0][0])
            before = first[0][0].weight_versions[0]["version"]
            assert before != "2"
            n = len(joined.output_ids)
            assert joined.weight_versions == [
                {"version": before, "start": 0, "end": chunk},
                {"version": "2", "start": chunk, "end": n},
            ]
            np.testing.assert_array_equal(joined.routing[: len(first[0][0].routing)], first[0][0].routing)
            assert len(joined.routing) == len(prompt) + n - 1

    with running_servers(model, tmp_path / "logs", 2) as urls:
        asyncio.run(go(urls))


def shape_of(shape) -> tuple[int, int]:
    return len(shape.moe_layers), shape.topk
