"""Tasks, reward functions and the rollout buffer's staleness and accounting rules."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import zmq

from moerl.errors import MoerlError
from moerl.models.tiny import tiny_tokenizer
from moerl.orchestrator.config import RolloutSection
from moerl.orchestrator.messages import (
    Generate,
    GroupDone,
    Issued,
    RolloutFailed,
    Stop,
    Stopped,
    event_frames,
    send_event,
)
from moerl.orchestrator.rollouts import RolloutBuffer, RolloutError
from moerl.rewards import Rewarder
from moerl.rewards.rules import math
from moerl.rewards.score import Score
from moerl.sample import Sample
from moerl.tasks import PromptStream, TaskConfig, read_records


def test_math_reward_checks_the_final_answer_with_math_verify():
    gold = "24 + 18 = 42 muffins were made. 42 - 30 = 12 are left.\n#### 12"
    assert math("So there are \\boxed{12} muffins left.", gold) == 1.0
    assert math("The answer is 12.", gold) == 1.0
    assert math("The answer is 13.", gold) == 0.0
    assert math("I do not know", gold) == 0.0


def test_gsm8k_sample_ships_and_scores_its_own_answers():
    stream = PromptStream(TaskConfig(name="gsm8k"), tiny_tokenizer())
    rewarder = Rewarder(TaskConfig(name="gsm8k"))
    record = stream.record(0)
    final = record["answer"].rsplit("####", 1)[1].strip()
    scores = asyncio.run(rewarder.score([f"... so \\boxed{{{final}}}", "no idea"], record["answer"], record["prompt"]))
    assert [s.outcome for s in scores] == [1.0, 0.0]


def test_prompt_stream_is_seeded_reshuffled_per_epoch_and_addressable(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"q": f"p{i}", "a": str(i)}) + "\n" for i in range(5)))
    cfg = TaskConfig(name="file", path=str(path), prompt_key="q", answer_key="a", seed=3)
    a, b = PromptStream(cfg, tiny_tokenizer()), PromptStream(cfg, tiny_tokenizer())
    first = [a.record(i)["prompt"] for i in range(10)]
    assert sorted(first[:5]) == sorted(first[5:]) == [f"p{i}" for i in range(5)]  # each epoch covers the data once
    assert first[:5] != first[5:]  # and in a new order
    assert [b.record(i)["prompt"] for i in reversed(range(10))] == first[::-1]  # random access: resumable
    record, ids = a.get(0)
    assert tiny_tokenizer().decode(ids) == record["prompt"]


def test_a_chat_template_prompt_is_the_templates_token_ids(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "2+2", "answer": "4"}) + "\n")
    cfg = TaskConfig(name="file", path=str(path), chat_template=True, system_prompt="Be brief.")
    record, ids = PromptStream(cfg, tiny_tokenizer()).get(0)
    assert all(isinstance(i, int) for i in ids)
    text = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2<|im_end|>\n<|im_start|>assistant\n"
    assert tiny_tokenizer().decode(ids) == text


def test_parquet_records_and_clear_errors_for_bad_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}), tmp_path / "d.parquet")
    assert read_records(tmp_path / "d.parquet") == [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4"},
    ]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(MoerlError, match="record 0 has no answer"):
        read_records(tmp_path / "bad.jsonl")
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    with pytest.raises(MoerlError, match="broken.jsonl:1: not a JSON object"):
        read_records(tmp_path / "broken.jsonl")
    with pytest.raises(MoerlError, match="task.name=file needs task.path"):
        TaskConfig(name="file")


def length_reward(response, answer, prompt=""):
    return float(len(response))


async def async_reward(response, answer, prompt=""):
    await asyncio.sleep(0)
    return float(response == answer)


def rank_group(responses, answer, prompt=""):
    order = np.argsort([len(r) for r in responses])
    ranks = np.empty(len(responses))
    ranks[order] = np.arange(len(responses))
    return list(ranks)


def test_named_sync_async_and_group_rewards():
    def score(cfg, responses):
        return [s.outcome for s in asyncio.run(Rewarder(cfg).score(responses, "ab", "p"))]

    assert score(TaskConfig(name="tiny", reward="tests.tasks.test_tasks:length_reward"), ["a", "abc"]) == [1.0, 3.0]
    assert score(TaskConfig(name="tiny", reward="tests.tasks.test_tasks:async_reward"), ["ab", "x"]) == [1.0, 0.0]
    assert score(
        TaskConfig(name="tiny", reward="tests.tasks.test_tasks:rank_group", group_reward=True), ["abc", "a", "ab"]
    ) == [2.0, 0.0, 1.0]
    with pytest.raises(MoerlError, match="cannot be loaded"):
        Rewarder(TaskConfig(name="tiny", reward="tests.tasks.test_tasks:missing"))
    with pytest.raises(MoerlError, match="expected one of exact, math, tiny"):
        Rewarder(TaskConfig(name="tiny", reward="nonsense"))


def test_remote_verifier_is_called_per_response():
    from aiohttp import web

    from tests.engine_server import serving

    async def main():
        seen = []

        async def verify(request):
            body = await request.json()
            seen.append(body)
            return web.json_response({"reward": float(body["response"] == body["answer"])})

        async with serving({("POST", "/verify"): verify}) as url:
            rewarder = Rewarder(TaskConfig(name="tiny", reward_url=f"{url}/verify"))
            try:
                return await rewarder.score(["7", "8"], "7", "3+4="), seen
            finally:
                await rewarder.close()

    rewards, seen = asyncio.run(main())
    assert rewards == [Score(1.0), Score(0.0)]
    assert sorted(s["response"] for s in seen) == ["7", "8"] and all(s["prompt"] == "3+4=" for s in seen)


# ---- the buffer ------------------------------------------------------------------------------
def group_event(index: int, versions: list[int]) -> GroupDone:
    samples = [
        Sample(
            prompt_ids=np.array([1, 2], np.int32),
            response_ids=np.array([3, 4], np.int32),
            behaviour_logprobs=np.zeros(2, np.float32),
            versions=np.array([v, v], np.int64),
            reward=float(i),
            group_id=index,
        )
        for i, v in enumerate(versions)
    ]
    return GroupDone(index, samples, retries=0, seconds=0.1)


@pytest.fixture
def wired():
    ctx = zmq.Context()
    buffer = RolloutBuffer(ctx, RolloutSection(groups_per_step=2, max_staleness=1), "async")
    manager_in, manager_out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    manager_in.connect(buffer.orders_address)
    manager_out.connect(buffer.events_address)
    yield buffer, manager_in, manager_out
    for s in (manager_in, manager_out):
        s.close(linger=0)
    buffer.close()
    ctx.term()


def test_buffer_drops_stale_groups_refills_and_accounts_for_every_prompt(wired):
    buffer, orders, events = wired
    for index in range(4):
        send_event(events, Issued(index, new=True))
    send_event(events, group_event(0, [3, 3]))  # version 3 at trainer version 5: too old
    send_event(events, group_event(1, [4, 5]))  # oldest token 1 version behind: kept
    send_event(events, group_event(2, [5, 5]))
    instalments = list(buffer.instalments(version=5, groups=2, whole=False))
    taken = [g.index for instalment in instalments for g in instalment]
    assert taken == [1, 2]
    assert [orders.recv_pyobj() for _ in range(3)] == [Generate(1)] * 3  # one more group for each taken or dropped
    counts = buffer.acct.counts()
    assert counts["prompts/dropped"] == 1 and counts["prompts/in_flight"] == 1 and counts["prompts/taken"] == 2
    buffer.trained([g for instalment in instalments for g in instalment])
    assert buffer.acct.trained == 2 and buffer.pending() == [3] and buffer.acct.balanced()
    assert buffer.cursor == 4  # where a resumed run continues
    send_event(events, Issued(3, new=False))  # re-issued after a resume: counted once
    buffer.drain()
    assert buffer.acct.issued == 4 and buffer.acct.balanced()
    send_event(events, Stopped([3]))
    buffer.stop(timeout_s=5)
    assert orders.recv_pyobj() == Stop()
    assert (
        dict(buffer.acct.dropped) == {"stale": 1, "in_flight_at_stop": 1}
        and buffer.acct.balanced()
        and not buffer.acct.live
    )


def test_a_groups_arrays_cross_out_of_band_and_arrive_whole_and_writable(wired):
    """An event's arrays go as frames of their own, not copied into its pickle; the buffer's come back equal, in memory
    of their own."""
    buffer, _, events = wired
    event = group_event(0, [0, 0])
    routing = np.random.default_rng(0).integers(0, 128, (3, 48, 8), dtype=np.uint8)  # P + R - 1 positions
    event.samples[1].routing = np.repeat(routing, 1000, axis=1)  # 1.1 MB
    frames = event_frames(event)
    assert len(frames[0]) < 4096 and sum(len(memoryview(f)) for f in frames[1:]) > routing.nbytes * 1000
    send_event(events, Issued(0, new=True))
    send_event(events, event)
    (instalment,) = buffer.instalments(version=0, groups=1, whole=True)
    (group,) = instalment
    for sent, got in zip(event.samples, group.samples, strict=True):
        for name in ("prompt_ids", "response_ids", "behaviour_logprobs", "versions", "routing"):
            a, b = getattr(sent, name), getattr(got, name)
            assert (a is None and b is None) or (np.array_equal(a, b) and a.dtype == b.dtype and b.flags.writeable)


def test_a_failed_rollout_stops_the_run_with_its_message(wired):
    buffer, _, events = wired
    send_event(events, RolloutFailed(7, "EngineError: http://e:1: /generate refused (400): bad top_k"))
    with pytest.raises(RolloutError, match="prompt 7 failed: EngineError.*bad top_k"):
        next(buffer.instalments(version=0, groups=1, whole=True))
