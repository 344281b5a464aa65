"""On-policy distillation's teacher: its log-probs of the student's tokens are a direct forward's, renormalised over
the kept sets as the student's are, left out at an episode's context; a replica that dies costs a retry, never a score;
and a teacher whose tokenizer is not the student's is refused before anything starts."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.models.tiny import save_tiny_hf
from moerl.sample import Sample
from tests.engine_server import running_pool

PROMPT = [3, 17, 42, 99, 7]
RESPONSE = [23, 5, 61, 200, 18, 150, 40]
TOP_K, KEPT_TOP = 3, 4


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return save_tiny_hf("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("teacher") / "model", seed=5)


@pytest.fixture(scope="module")
def forward(teacher_dir) -> torch.Tensor:
    """The teacher's log-probs, fp32: row j is its distribution of the response's token j given all before it."""
    hf = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([PROMPT + RESPONSE])).logits[0, :-1].float(), -1)
    return rows[len(PROMPT) - 1 :]


def _sample(forward: torch.Tensor, loss_mask: np.ndarray | None) -> Sample:
    """A sample of ``RESPONSE`` with kept sets at its actions: the teacher's own top ids there (so it covers them) and,
    at the first action, an id far down its distribution too (so it does not)."""
    r = len(RESPONSE)
    actions = np.ones(r, bool) if loss_mask is None else loss_mask.astype(bool)
    kept: list[list[int]] = []
    for j in range(r):
        if not actions[j]:
            kept.append([])
            continue
        ids = [RESPONSE[j], *(int(i) for i in forward[j].topk(KEPT_TOP - 1).indices if int(i) != RESPONSE[j])]
        if j == int(np.flatnonzero(actions)[0]):
            ids.append(int(forward[j].argmin()))  # not among the teacher's top ids
        kept.append(ids)
    offsets = np.concatenate([[0], np.cumsum([len(k) for k in kept])]).astype(np.int64)
    return Sample(
        prompt_ids=np.array(PROMPT, np.int32),
        response_ids=np.array(RESPONSE, np.int32),
        behaviour_logprobs=np.where(actions, -1.0, 0.0).astype(np.float32),
        versions=np.where(actions, 0, -1).astype(np.int64),
        selected_logprobs=np.where(actions, -0.5, 0.0).astype(np.float32),
        mask_offsets=offsets,
        mask_ids=np.array([i for k in kept for i in k], np.int32),
        loss_mask=loss_mask,
    ).validate()


@pytest.mark.e2e
def test_the_teachers_log_probs_are_a_forwards_renormalised_over_kept_sets_and_left_out_at_context(
    teacher_dir, forward, tmp_path
):
    """A single-turn sample and an episode's (context after its first turn, scored with the history it saw): each
    action's teacher log-prob is a transformers forward's of the whole stream (fp32, 1e-5), its top ids the forward's;
    over each kept set the teacher is renormalised exactly where its top ids cover the set, and bounded from below
    where they do not; the context's rows hold 0.0, as the sample contract holds there."""
    from moerl.rewards.model import Replicas, Stats
    from moerl.rewards.teacher import Teacher

    episode_mask = np.array([1, 1, 0, 0, 1, 1, 1], np.uint8)
    samples = [_sample(forward, None), _sample(forward, episode_mask)]
    with running_pool(teacher_dir, tmp_path / "logs", 1) as pool:

        async def go() -> Stats:
            teacher = Teacher(Replicas(pool.urls), top_k=TOP_K, kept_sets=True, kept_top=KEPT_TOP)
            stats = Stats(float)
            try:
                await teacher.score(samples, "teacher-p0", stats)
            finally:
                await teacher.close()
            return stats

        stats = asyncio.run(go())
    direct = forward.gather(1, torch.tensor(RESPONSE)[:, None]).squeeze(1).numpy()
    top = forward.topk(TOP_K, -1)
    for sample in samples:
        actions = sample.actions
        assert sample.teacher_logprobs is not None and sample.teacher_top_ids is not None
        np.testing.assert_allclose(sample.teacher_logprobs[actions], direct[actions], atol=1e-5)
        assert np.all(sample.teacher_logprobs[~actions] == 0) and np.all(sample.teacher_top_ids[~actions] == 0)
        assert np.array_equal(sample.teacher_top_ids[actions], top.indices.numpy()[actions])
        np.testing.assert_allclose(sample.teacher_top_logprobs[actions], top.values.numpy()[actions], atol=1e-5)
        selected = sample.teacher_selected_logprobs
        assert selected is not None and np.all(selected[~actions] == 0)
        first = int(np.flatnonzero(actions)[0])
        for j in np.flatnonzero(actions):
            kept = sample.mask_ids[sample.mask_offsets[j] : sample.mask_offsets[j + 1]]
            exact = float(direct[j] - torch.logsumexp(forward[j, torch.tensor(kept, dtype=torch.long)], 0))
            if j == first:  # an id past the top ones: counted at the least of them, a lower bound within the gap
                assert exact - gap_bound(sample, forward, j) - 1e-5 <= selected[j] < exact
            else:
                assert selected[j] == pytest.approx(exact, abs=1e-5)
    assert stats["teacher_engines/requests"] == 2 and stats["teacher_engines/retries"] == 0
    assert stats["teacher_engines/actions"] == len(RESPONSE) + int(episode_mask.sum())
    assert stats["teacher_engines/kept_set_exact"] == stats["teacher_engines/actions"] - 2
    assert stats["teacher_engines/kept_set_gap"] > 0


def gap_bound(sample: Sample, forward: torch.Tensor, j: int) -> float:
    """log(1 + (kept ids past the top ones) x (the least top probability) / (the listed ids' mass)) at action j."""
    kept = sample.mask_ids[sample.mask_offsets[j] : sample.mask_offsets[j + 1]].tolist()
    top = forward[j].topk(KEPT_TOP)
    listed = {*top.indices.tolist(), RESPONSE[j]}
    known = torch.logsumexp(forward[j, [k for k in kept if k in listed]], 0).exp()
    unlisted = sum(k not in listed for k in kept) * top.values[-1].exp()
    return float(torch.log1p(unlisted / known))


@pytest.mark.e2e
def test_a_teachers_large_answers_are_read_by_the_policy_clients_generation_workers(
    teacher_dir, forward, tmp_path, monkeypatch
):
    """Every answer counted large: the teacher's requests go through the generation workers it shares with the policy's
    client (a long response's top ids are tens of MB of JSON, not for the manager's loop), with the same log-probs as a
    forward's; closing the teacher leaves the shared workers to their owner."""
    import psutil

    from moerl.engines import client as client_module
    from moerl.engines.client import EngineClient
    from moerl.rewards.model import Replicas, Stats
    from moerl.rewards.teacher import Teacher

    monkeypatch.setattr(client_module, "CARRY_ELSEWHERE_BYTES", 0)
    direct = forward.gather(1, torch.tensor(RESPONSE)[:, None]).squeeze(1).numpy()
    with running_pool(teacher_dir, tmp_path / "logs", 1) as pool:

        async def go() -> tuple[Sample, list[int], bool]:
            policy = EngineClient(pool.urls, workers=1)
            teacher = Teacher(Replicas(pool.urls), top_k=TOP_K, kept_sets=False, kept_top=0, workers=policy.workers)
            sample = _sample(forward, None)
            try:
                await teacher.score([sample], "teacher-p0", Stats(float))
            finally:
                await teacher.close()
            carriers = policy.worker_pids()
            alive = all(psutil.pid_exists(pid) for pid in carriers)
            await policy.close()
            return sample, carriers, alive

        sample, carriers, alive = asyncio.run(go())
    assert len(carriers) == 1 and alive  # the worker carried it, and outlived the teacher's close
    np.testing.assert_allclose(sample.teacher_logprobs, direct, atol=1e-5)
    assert np.array_equal(sample.teacher_top_ids, forward.topk(TOP_K, -1).indices.numpy())


@pytest.mark.e2e
def test_a_teacher_that_is_the_student_scores_each_token_as_it_was_sampled(teacher_dir, tmp_path):
    """The student's own engine as its teacher: on completions it sampled at temperature 1 with kept sets (top-k 8),
    the teacher's log-probs are the behaviour log-probs and, renormalised over the kept sets (which its top 8 ids cover
    exactly), the selected ones: the reverse KL the trainer takes is 0."""
    from moerl.engines.client import EngineClient, Returns
    from moerl.engines.protocol import SamplingParams
    from moerl.rewards.model import Replicas, Stats
    from moerl.rewards.teacher import Teacher

    params = SamplingParams(n=4, max_new_tokens=8, temperature=1.0, top_k=8, sampling_seed=3, ignore_eos=True)
    with running_pool(teacher_dir, tmp_path / "logs", 1) as pool:

        async def go() -> tuple[list[Sample], Stats]:
            async with EngineClient(pool.urls) as client:
                completions = await client.generate(PROMPT, params, Returns(sampling_mask=True))
            samples = [Sample.from_completion(c, PROMPT, temperature=1.0, versions={"default": 0}) for c in completions]
            teacher = Teacher(Replicas(pool.urls), top_k=0, kept_sets=True, kept_top=8)
            stats = Stats(float)
            try:
                await teacher.score(samples, "teacher-p0", stats)
            finally:
                await teacher.close()
            return samples, stats

        samples, stats = asyncio.run(go())
    for s in samples:
        np.testing.assert_allclose(s.teacher_logprobs, s.behaviour_logprobs, atol=1e-5)
        np.testing.assert_allclose(s.teacher_selected_logprobs, s.selected_logprobs, atol=1e-5)
    assert stats["teacher_engines/kept_set_exact"] == stats["teacher_engines/actions"] == 4 * 8
    assert stats["teacher_engines/kept_set_gap"] == 0


@pytest.mark.e2e
def test_a_teacher_replica_that_dies_costs_a_retry_and_one_started_again_scores_what_waited(
    teacher_dir, forward, tmp_path
):
    """Two replicas, the one a group's affinity picks SIGKILLed: its request fails, is counted, and is asked again of
    the other, with the same log-probs. Then the other dies too: the scoring waits for a replica, started again, and
    its log-probs are the same once it answers; nothing is lost or made up."""
    from moerl.rewards.model import Replicas, Stats
    from moerl.rewards.teacher import Teacher

    with running_pool(teacher_dir, tmp_path / "logs", 2) as pool:

        async def go():
            teacher = Teacher(Replicas(pool.urls, health_interval_s=0.2), 0, False, 0)
            try:
                before = _sample(forward, None)
                await teacher.score([before], "teacher-p0", Stats(float))
                assert before.teacher_top_ids is None and before.teacher_selected_logprobs is None
                picked = pool.urls.index(sorted(pool.urls)[_affinity_index("teacher-p0", 2)])
                os.killpg(pool.procs[picked].pid, signal.SIGKILL)
                pool.procs[picked].wait()
                stats, after = Stats(float), _sample(forward, None)
                await teacher.score([after], "teacher-p0", stats)
                assert stats["teacher_engines/retries"] == 1
                assert np.array_equal(after.teacher_logprobs, before.teacher_logprobs)
                other = 1 - picked
                os.killpg(pool.procs[other].pid, signal.SIGKILL)
                pool.procs[other].wait()
                again = _sample(forward, None)
                waiting = asyncio.create_task(teacher.score([again], "teacher-p1", Stats(float)))
                await asyncio.sleep(1.0)
                assert not waiting.done()
                assert sorted(await asyncio.to_thread(pool.revive, 3)) == sorted(pool.urls)
                await waiting
                np.testing.assert_allclose(again.teacher_logprobs, before.teacher_logprobs, atol=1e-6)
            finally:
                await teacher.close()

        asyncio.run(go())


def _affinity_index(key: str, replicas: int) -> int:
    import zlib

    return zlib.crc32(key.encode()) % replicas


def test_renormalising_over_a_kept_set_is_exact_where_the_top_ids_cover_it():
    """Two actions and a context row: the first's kept set within the teacher's top ids (exact), the second's with an
    id past them (counted at the least top log-prob); the context's row is 0."""
    from moerl.rewards.teacher import renormalised

    logprobs = np.array([-0.5, 0.0, -2.0])
    targets = np.array([4, 9, 7])
    offsets = np.array([0, 2, 2, 4])
    kept = np.array([4, 5, 7, 8])
    top_ids = np.array([[4, 5, 6], [0, 0, 0], [1, 2, 7]])
    top_logprobs = np.array([[-0.5, -1.5, -3.0], [0, 0, 0], [-0.3, -1.0, -2.0]])
    out, gap = renormalised(logprobs, targets, offsets, kept, top_ids, top_logprobs)
    assert out[0] == pytest.approx(-0.5 - np.logaddexp(-0.5, -1.5)) and gap[:2].tolist() == [0, 0]
    assert out[1] == 0 and out[2] == pytest.approx(-2.0 - np.logaddexp(-2.0, -2.0))  # 8 counted at the least, -2.0
    # the exact value lies within the gap above it: 8's own mass is anywhere in (0, e^-2.0]
    assert gap[2] == pytest.approx(np.logaddexp(-2.0, -2.0) - -2.0)


def test_a_teacher_with_another_tokenizer_or_without_a_distillation_loss_is_refused(teacher_dir, demo_cache, tmp_path):
    """The teacher scores the student's token ids: a tokenizer that maps a token to another id is refused naming the
    token, given models or the demo student's (once made, before the teacher's engines start); a teacher without
    trainer.loss.distill, or the loss without a teacher, is refused naming the other key."""
    from moerl.errors import ConfigError
    from moerl.orchestrator.config import load_config, scorers
    from moerl.orchestrator.model_cache import prepare_scorer_model
    from moerl.orchestrator.preflight import check_tokenizers

    student = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "student")
    check_tokenizers(student, teacher_dir)  # one family's tokenizer: accepted
    other = tmp_path / "other"
    shutil.copytree(teacher_dir, other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"its tokenizer is not the student's .* 2 of the student's \d+ tokens .*'a'"):
        check_tokenizers(student, other)
    demo_student = load_config(
        None, [f"run.cache_dir={demo_cache}", f"teacher.model={other}", "trainer.loss.distill.coef=1"]
    )
    with pytest.raises(ConfigError, match=r"its tokenizer is not the student's .* 2 of the student's \d+ tokens .*'a'"):
        prepare_scorer_model(demo_student, scorers(demo_student)[0])
    with pytest.raises(ConfigError, match="set trainer.loss.distill.coef > 0"):
        load_config(None, [f"teacher.model={teacher_dir}"])
    with pytest.raises(ConfigError, match="distillation learns from a teacher; set teacher.model"):
        load_config(None, ["trainer.loss.distill.coef=1"])
    with pytest.raises(
        ConfigError, match="teacher.engines.gpus_per_replica=2: the embedded engine serves on one device"
    ):
        load_config(
            None,
            [f"teacher.model={teacher_dir}", "trainer.loss.distill.coef=1"]
            + ["teacher.engines.server=embedded", "teacher.engines.gpus_per_replica=2"],
        )
