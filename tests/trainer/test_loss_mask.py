"""Agent episodes: one token stream per sample, the model's tokens (actions) scored and the context (environment,
tool, template tokens) only fed. Micro-batches score exactly the actions, the wire carries the loss mask where a sample
has context and nothing more where none has, GRPO counts a forked episode once, and the trainer's log-probs and
gradient are those of a transformers forward over the whole stream with the context left out of the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moerl.megatron.launch import run_ranks
from moerl.sample import Sample
from moerl.trainer.batch import build_micro_batch, shard_by_tokens
from moerl.trainer.distribute import Needs, _fields, _pack, _unpack
from moerl.trainer.objectives import grpo_advantages

ARCH = "Qwen3MoeForCausalLM"
VOCAB = 256  # the tiny models'


def stream(
    rng: np.random.Generator,
    prompt_len: int,
    turns: list[tuple[int, int]],
    reward: float = 0.0,
    group: int = 0,
    episode: int | None = None,
    kept: bool = False,
    routing_layers: int = 0,
) -> Sample:
    """A sample of random tokens: a prompt, then per turn ``(model tokens, context tokens)``; actions sampled at
    version 0, each with a kept set of itself and the next id where ``kept``."""
    response = rng.integers(0, VOCAB, sum(m + c for m, c in turns)).astype(np.int32)
    mask = np.concatenate([np.r_[np.ones(m), np.zeros(c)] for m, c in turns]).astype(np.uint8)
    actions = mask.astype(bool)
    logprobs = np.where(actions, -rng.uniform(0.1, 3.0, len(response)), 0.0).astype(np.float32)
    sample = Sample(
        prompt_ids=rng.integers(0, VOCAB, prompt_len).astype(np.int32),
        response_ids=response,
        behaviour_logprobs=logprobs,
        versions=np.where(actions, 0, -1).astype(np.int64),
        reward=reward,
        group_id=group,
        loss_mask=mask if not actions.all() else None,
        episode=episode,
    )
    if kept:
        sample.selected_logprobs = logprobs / 2
        sample.mask_offsets = np.concatenate([[0], np.cumsum(2 * mask)]).astype(np.int64)
        sample.mask_ids = np.stack([response, (response + 1) % VOCAB], 1)[actions].ravel().astype(np.int32)
    if routing_layers:
        sample.routing = rng.integers(0, 8, (sample.fed_len, routing_layers, 2)).astype(np.uint8)
    return sample.validate()


# ---- (a) micro-batches score the actions only ----------------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_scores_exactly_the_actions(packed):
    multi = Sample(
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.array([10, 11, 20, 21, 22, 12], np.int32),  # a turn, a tool's answer, a turn
        behaviour_logprobs=np.array([-1, -2, 0, 0, 0, -3], np.float32),
        versions=np.array([0, 1, -1, -1, -1, 2]),
        selected_logprobs=np.array([-0.1, -0.2, 0, 0, 0, -0.3], np.float32),
        mask_offsets=np.array([0, 2, 4, 4, 4, 4, 6]),
        mask_ids=np.array([10, 11, 11, 12, 12, 13], np.int32),
        loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8),
    ).validate()
    single = Sample(
        prompt_ids=np.array([5, 6], np.int32),
        response_ids=np.array([30, 31], np.int32),
        behaviour_logprobs=np.array([-4, -5], np.float32),
        versions=np.array([3, 3]),
        temperature=0.5,
        selected_logprobs=np.array([-0.4, -0.5], np.float32),
        mask_offsets=np.array([0, 1, 2]),
        mask_ids=np.array([30, 31], np.int32),
    ).validate()
    mb = build_micro_batch(
        [multi, single], [1.5, -0.5], [0.25, 0.75], multiple=2, use_masks=True, routed_experts=None, packed=packed
    )
    # the context is fed like the prompt
    fed = [1, 2, 3, 10, 11, 20, 21, 22]
    if packed:
        assert mb.input_ids.tolist() == [fed + [5, 6, 30, 0]]
        assert mb.rows.tolist() == [0] * 5 and mb.cols.tolist() == [2, 3, 7, 9, 10]
    else:
        assert mb.input_ids.tolist() == [fed, [5, 6, 30, 0, 0, 0, 0, 0]]
        assert mb.rows.tolist() == [0, 0, 0, 1, 1] and mb.cols.tolist() == [2, 3, 7, 1, 2]
    assert mb.num_tokens == 5 and mb.targets.tolist() == [10, 11, 12, 30, 31]
    assert torch.equal(mb.input_ids[mb.rows, mb.cols], torch.tensor([3, 10, 22, 6, 30]))  # the token before each
    assert mb.seq.tolist() == [0, 0, 0, 1, 1]
    assert mb.temperature.tolist() == [1.0, 1.0, 1.0, 0.5, 0.5]
    assert mb.weights.tolist() == [0.25] * 3 + [0.75] * 2 and mb.advantages.tolist() == [1.5] * 3 + [-0.5] * 2
    torch.testing.assert_close(mb.behaviour, torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]))
    assert mb.versions.tolist() == [0, 1, 2, 3, 3]
    # one kept set per action, in order: the context's empty ones are gone
    assert mb.mask_offsets.tolist() == [0, 2, 4, 6, 7, 8]
    assert mb.mask_ids.tolist() == [10, 11, 11, 12, 12, 13, 30, 31]
    without_masks = build_micro_batch(
        [multi, single], [1.5, -0.5], [0.25, 0.75], 2, use_masks=False, routed_experts=None
    )
    assert without_masks.behaviour.tolist() == [-1, -2, -3, -4, -5] and without_masks.mask_offsets is None


# ---- (c) GRPO over episodes ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("std_normalize", [True, False])
def test_a_forked_episode_counts_once_and_each_of_its_samples_takes_its_advantage(std_normalize):
    # group 0: episode 0, episode 1 forked into two samples, a single-turn sample; group 1: single-turn samples
    rewards = np.array([1.0, 0.0, 0.0, 0.25, 0.5, 0.0])
    groups = np.array([0, 0, 0, 0, 1, 1])
    forked = grpo_advantages(rewards, groups, std_normalize, episodes=[0, 1, 1, None, None, None])
    unforked = grpo_advantages(
        np.delete(rewards, 2), np.delete(groups, 2), std_normalize, episodes=[0, 1, None, None, None]
    )
    np.testing.assert_array_equal(np.delete(forked, 2), unforked)
    assert forked[2] == forked[1]
    episodes = np.array([1.0, 0.0, 0.25])  # group 0's episodes, each once
    expected = episodes - episodes.mean()
    if std_normalize:
        expected /= episodes.std() + 1e-6
    np.testing.assert_allclose(forked[[0, 1, 3]], expected, rtol=1e-6)
    np.testing.assert_allclose(forked[4:], [0.25, -0.25] if not std_normalize else [1, -1], rtol=1e-5)


def test_episodes_are_keyed_by_group_and_single_turn_advantages_are_as_before():
    # episode 0 of group 0 (two samples) and episode 0 of group 1 are different episodes
    adv = grpo_advantages(np.array([1.0, 1.0, 0.0, 1.0]), np.array([0, 0, 1, 1]), True, episodes=[0, 0, 0, 1])
    assert adv[0] == adv[1] == 0.0  # one episode: nothing to compare it with
    assert adv[2] < 0 < adv[3]
    rng = np.random.default_rng(0)
    rewards, groups = rng.uniform(size=12), np.repeat(np.arange(3), 4)
    for std_normalize in (True, False):
        before = np.empty(12)  # the formula over samples
        for g in range(3):
            r = rewards[groups == g]
            before[groups == g] = (r - r.mean()) / (r.std() + 1e-6) if std_normalize else r - r.mean()
        for episodes in (None, [None] * 12):
            got = grpo_advantages(rewards, groups, std_normalize, episodes=episodes)
            np.testing.assert_array_equal(got, before.astype(np.float32))


def test_the_samples_of_one_episode_must_share_its_reward():
    with pytest.raises(ValueError, match="group 3: the samples of one episode carry different rewards"):
        grpo_advantages(np.array([1.0, 0.5]), np.array([3, 3]), True, episodes=[2, 2])


# ---- (d) the wire ---------------------------------------------------------------------------------------------------
def _round_trip(samples: list[Sample], needs: Needs, masks: bool) -> tuple[list[str], int, list[Sample]]:
    """The fields a rank with ``needs`` receives, its payload's bytes, and the samples it unpacks."""
    prompt, response, actions = (
        np.array([getattr(s, attr) for s in samples]) for attr in ("prompt_len", "response_len", "action_count")
    )
    kept = np.array([len(s.mask_ids) if masks else 0 for s in samples])
    skips = np.zeros(len(samples), dtype=np.int64)  # each sample sends its whole prompt
    fields = _fields(needs, prompt, response, kept, actions, (np.uint8, 2), masks, skips)
    buffer = _pack(samples, needs, fields, masks, skips)
    temperature = np.array([s.temperature for s in samples])
    unpacked = _unpack(buffer, fields, prompt, response, temperature, actions, skips)
    return [name for name, _, _ in fields], len(buffer), unpacked


@pytest.mark.parametrize("masks", [True, False])
def test_the_wire_carries_the_loss_mask_to_the_last_stage_and_only_for_samples_with_context(masks):
    rng = np.random.default_rng(1)
    samples = [
        stream(rng, 3, [(2, 3), (1, 4), (2, 0)], kept=True, routing_layers=2),
        stream(rng, 2, [(5, 0)], kept=True, routing_layers=2),  # single-turn: no mask
        stream(rng, 4, [(1, 6), (3, 1)], kept=True, routing_layers=2),
    ]
    last = Needs(dp_rank=0, ids=True, last=True, columns=(0, 1))
    names, nbytes, got = _round_trip(samples, last, masks)
    assert "loss_mask" in names
    for g, s in zip(got, samples, strict=True):
        assert (g.loss_mask is None) == (s.loss_mask is None)
        if s.loss_mask is not None:
            assert g.loss_mask.dtype == np.uint8 and np.array_equal(g.loss_mask, s.loss_mask)
        assert np.array_equal(g.prompt_ids, s.prompt_ids) and np.array_equal(g.response_ids, s.response_ids)
        assert np.array_equal(g.versions, s.versions) and np.array_equal(g.routing, s.routing)
        behaviour = s.selected_logprobs if masks else s.behaviour_logprobs
        assert np.array_equal(g.behaviour_logprobs, behaviour)
        if masks:
            assert np.array_equal(g.mask_offsets, s.mask_offsets) and np.array_equal(g.mask_ids, s.mask_ids)
        g.validate()  # the context's values made on arrival are the contract's
    # the loss's arrays travel for the actions only, the mask as a byte per response token of the samples with context
    assert nbytes == _last_stage_bytes(samples, masks, [s.action_count for s in samples], with_mask=True)

    # a middle stage reads no loss, so no mask
    middle, _, got = _round_trip(samples, Needs(dp_rank=0, ids=False, last=False, columns=(1,)), masks)
    assert middle == ["routing"] and all(g.loss_mask is None for g in got)
    # single-turn samples: no mask field, and every response token's arrays as before
    single = [samples[1], stream(rng, 5, [(3, 0)], kept=True, routing_layers=2)]
    names, nbytes, got = _round_trip(single, last, masks)
    assert "loss_mask" not in names and all(g.loss_mask is None for g in got)
    assert nbytes == _last_stage_bytes(single, masks, [s.response_len for s in single], with_mask=False)


def _last_stage_bytes(samples: list[Sample], masks: bool, scored: list[int], with_mask: bool) -> int:
    """A last stage's payload when ``scored`` tokens of each sample carry the loss's arrays: ids, behaviour log-probs,
    versions, kept sets, the loss mask of the samples with context, routing (2 columns, top-2, uint8); each field
    8-byte aligned."""
    tokens = sum(scored)
    sizes = [4 * sum(s.prompt_len + s.response_len for s in samples), 4 * tokens, 8 * tokens]
    if masks:
        sizes += [4 * tokens, 4 * sum(len(s.mask_ids) for s in samples)]
    if with_mask:
        sizes.append(sum(s.response_len for s in samples if s.loss_mask is not None))
    sizes.append(2 * 2 * sum(s.fed_len for s in samples))
    return sum(-(-n // 8) * 8 for n in sizes)


# ---- (b) the trainer against transformers --------------------------------------------------------------------------
def _hf_reference(hf_dir, samples: list[Sample], advantages: np.ndarray) -> dict:
    """Per sample the log-probs of its actions under a transformers forward over its whole stream; the gradient (under
    Megatron names) of the token-mean policy loss at ratio 1 over the actions, and over every response token."""
    from transformers import AutoModelForCausalLM

    from moerl.models import family_for
    from tests.conftest import hub_grads

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    family = family_for(model.config.to_dict())
    cfg = family.normalize(model.config.to_dict())
    out: dict = {"logprobs": []}
    per_token = []
    for s in samples:
        logits = model(torch.from_numpy(s.fed_ids().astype(np.int64))[None]).logits[0, s.prompt_len - 1 :]
        logp = torch.log_softmax(logits / s.temperature, -1).gather(1, torch.from_numpy(s.response_ids).long()[:, None])
        per_token.append(logp[:, 0])
        out["logprobs"].append(logp[torch.from_numpy(s.actions), 0].detach())
    for name, scored in (("grads", lambda s: s.actions), ("grads_all", lambda s: np.ones(s.response_len, bool))):
        model.zero_grad(set_to_none=True)  # the last loop's gradients stay as hub_grads took them
        count = sum(int(scored(s).sum()) for s in samples)
        loss = sum(
            -float(a) * logp[torch.from_numpy(scored(s))].sum() / count
            for s, a, logp in zip(samples, advantages, per_token, strict=True)
        )
        loss.backward(retain_graph=True)
        hub = hub_grads(model)
        out[name] = {r.mcore: family.to_mcore(r, [hub[n] for n in r.hf], cfg) for r in family.all_rules(cfg)}
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [{}, {"pp": 2}], ids=["DP2", "PP2"])
def test_the_trainer_scores_and_trains_on_the_actions_of_the_whole_stream(tiny_ckpts, layout):
    """DP2: rank 1 takes its samples off the wire; PP2: the first stage, which only feeds, gets no loss mask. The
    old-policy log-probs at the actions are transformers' over the whole stream, context included as input; the step's
    gradient is that of the loss over the actions alone, far from the one over every response token; the advantages
    count the forked episode once."""
    from moerl.trainer.config import OptimConfig, ReplayConfig, TrainerConfig
    from moerl.trainer.objectives import LossConfig
    from tests.trainer.loss_mask_workers import action_logprobs_and_step

    rng = np.random.default_rng(7)
    samples = [
        stream(rng, 4, [(3, 4), (2, 3), (3, 0)], reward=1.0, episode=0),
        stream(rng, 3, [(2, 5), (4, 0)], reward=0.0, episode=1),
        stream(rng, 6, [(3, 2), (2, 0)], reward=0.0, episode=1),  # a fork of episode 1
        stream(rng, 5, [(6, 0)], reward=0.25),  # single-turn: an episode of its own
        stream(rng, 2, [(4, 0)], reward=0.5, group=1),
        stream(rng, 3, [(1, 3), (2, 2), (1, 0)], reward=0.0, group=1),
    ]
    cfg = TrainerConfig(
        micro_batch_tokens=32,  # several micro-batches a rank
        loss=LossConfig(correction="none"),  # the gradient at ratio 1 is the policy gradient alone
        replay=ReplayConfig(routing="off", sampling_mask=False),
        optim=OptimConfig(lr=1e-3, clip_grad=1e9),
        **layout,
    )
    ranks = run_ranks(action_logprobs_and_step, 2, str(tiny_ckpts[ARCH][1]), cfg, samples)
    normalised = lambda r: (r - r.mean()) / (r.std() + 1e-6)
    group0, group1 = normalised(np.array([1.0, 0.0, 0.25])), normalised(np.array([0.5, 0.0]))  # over episodes
    advantages = np.array([group0[0], group0[1], group0[1], group0[2], *group1])
    reference = _hf_reference(tiny_ckpts[ARCH][0], samples, advantages)

    shards = shard_by_tokens([s.fed_len for s in samples], 2 // cfg.pp)
    assert [out["last"] for out in ranks] == ([True, True] if cfg.pp == 1 else [False, True])
    for rank, out in enumerate(ranks):
        assert out["action_counts"].tolist() == [s.action_count for s in samples]
        shard = shards[rank if cfg.pp == 1 else 0]
        for got, i, logp, adv in zip(out["samples"], shard, out["logprobs"], out["advantages"], strict=True):
            sent = samples[i]
            assert np.array_equal(got.response_ids, sent.response_ids)
            assert adv == pytest.approx(advantages[i], rel=1e-5)
            if not out["last"]:  # it feeds the stream and reads no loss
                assert got.loss_mask is None and logp is None
                continue
            assert (got.loss_mask is None) == (sent.loss_mask is None)
            assert len(logp) == sent.action_count
            torch.testing.assert_close(logp, reference["logprobs"][i], rtol=0, atol=1e-4)
        assert not out["last"] or any(got.loss_mask is not None for got in out["samples"])  # samples with context
    metrics = ranks[0]["metrics"]
    assert metrics["train/tokens"] == sum(s.action_count for s in samples)
    assert metrics["staleness/max"] == 0.0 and metrics["staleness/lag_0"] == 1.0  # context has no version to lag

    grads, expected, everything = ranks[0]["grads"], reference["grads"], reference["grads_all"]
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert (grads[name] - g).norm() <= 1e-4 * g.norm() + 1e-7, name
    flat = lambda d: torch.cat([d[n].flatten() for n in sorted(expected)])
    assert (flat(grads) - flat(everything)).norm() > 0.1 * flat(everything).norm()


# ---- the rollout side ------------------------------------------------------------------------------------------------
def test_staleness_and_rollout_metrics_count_the_model_tokens():
    from moerl.orchestrator.rollouts import Group, rollout_metrics

    rng = np.random.default_rng(3)
    turns = stream(rng, 3, [(2, 4), (2, 0)])
    turns.versions = np.array([3, 3, -1, -1, -1, -1, 4, 4])  # continued across a weight update
    single = stream(rng, 2, [(4, 0)])
    single.versions[:] = 5
    counts = {"episode/episodes": 2, "episode/turns": 3, "episode/tool_calls": 1, "episode/failed_timeout": 1}
    counts |= {"episode/malformed_tool_calls": 2, "episode/truncated": 1, "episode/truncated_agent_failed": 1}
    group = Group(0, [turns.validate(), single.validate()], episodes=counts)
    assert group.oldest_version() == 3  # not the context's -1
    metrics = rollout_metrics([group])
    assert metrics["episode/env_token_fraction"] == 4 / 12
    assert metrics["episode/turns_mean"] == 1.5 and metrics["episode/tool_calls"] == 1
    assert metrics["episode/failures"] == metrics["episode/failed_timeout"] == 1
    assert metrics["episode/malformed_tool_calls"] == 2
    assert metrics["episode/truncated"] == metrics["episode/truncated_agent_failed"] == 1
    assert metrics["rollout/mixed_version_fraction"] == 0.5
    assert metrics["rollout/response_len_mean"] == 6.0  # the response, context included
    assert not any(k.startswith("episode/") for k in rollout_metrics([Group(1, [single])]))  # single-turn: none


def test_check_replay_catches_a_rollout_that_overwrote_earlier_turns_routing(tmp_path):
    """A multi-turn rollout that asks for each turn's whole routing and replaces the rows it had (verl's and SkyRL's
    scheme) leaves a sample whose answers' rows start over at 0: check-replay names the sample and the position."""
    from moerl.trainer.replay_trace import check_replay, clear_step, write_source

    rng = np.random.default_rng(5)
    kept, overwritten = (stream(rng, 3, [(2, 4), (2, 0)], routing_layers=2) for _ in range(2))
    kept.routing_starts = np.array([0, 4])  # turn 2 asked from the rows turn 1 left off at
    overwritten.routing_starts = np.array([0, 0])  # turn 2 asked for them all again
    clear_step(tmp_path, 1)
    write_source(tmp_path, 1, [[kept.validate(), overwritten.validate()]], 2)
    report = check_replay(tmp_path)
    caught = [m for m in report.mismatches if m.what == "overwritten"]
    assert [(m.sample, m.position) for m in caught] == [("dp0-i1", 0)]
    assert "overwritten" in str(caught[0]) and not report.ok
