"""Process rewards, the trainer's side: the credit rules and the per-action advantages on hand-computed values, the
``trainer.loss.credit`` section, the wire carrying each action's advantage to the loss's stage alone (an outcome-only
instalment's bytes as they were), and trainer steps: equal step rewards train as the outcome alone does, and step values
reach the loss per token (the gradient transformers gives for it)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moerl.errors import ConfigError
from moerl.layout import Layout
from moerl.megatron.launch import run_ranks
from moerl.sample import Sample
from moerl.trainer.batch import build_micro_batch, shard_by_tokens
from moerl.trainer.config import OptimConfig, ReplayConfig, TrainerConfig
from moerl.trainer.distribute import _HEADER, Needs, _fields, _pack, _spans, _token_advantages
from moerl.trainer.objectives import (
    CREDITS,
    CreditConfig,
    LossConfig,
    grpo_advantages,
    min_credit,
    outcome_credit,
    process_advantages,
    sum_credit,
)
from tests.trainer.test_loss_mask import stream

ARCH = "Qwen3MoeForCausalLM"
EPS = 1e-6  # the normalisation's


def halved_later(step_values: np.ndarray) -> np.ndarray:
    """A plugin rule (``tests.trainer.test_credit:halved_later``): the reverse cumulative sum, halved."""
    return sum_credit(step_values) / 2


NOT_A_RULE = 3


# ---- the rules and the advantages ------------------------------------------------------------------------------------
def test_each_rule_on_hand_computed_values():
    steps = np.array([1.0, 0.0, 1.0])
    assert sum_credit(steps).tolist() == [2.0, 1.0, 1.0]  # each step and every later one
    assert min_credit(steps).tolist() == [0.0, 0.0, 1.0]  # the worst of each step and every later one
    assert min_credit(np.array([3.0, 1.0, 2.0])).tolist() == [1.0, 1.0, 2.0]
    assert outcome_credit(steps).tolist() == [0.0, 0.0, 0.0]
    assert sum_credit(np.array([-0.5])).tolist() == [-0.5] == min_credit(np.array([-0.5])).tolist()
    assert sorted(CREDITS.names) == ["min", "outcome", "sum"]


def _agent() -> Sample:
    """Prompt 2, then three turns: 2 actions; 1 context, 1 action; 2 context, 2 actions. A step is a turn with the
    context before it, so the actions' steps are [0, 0, 1, 2, 2]."""
    return Sample(
        prompt_ids=np.array([1, 2], np.int32),
        response_ids=np.arange(10, 18, dtype=np.int32),
        behaviour_logprobs=np.array([-1, -1, 0, -1, 0, 0, -1, -1], np.float32),
        versions=np.array([0, 0, -1, 0, -1, -1, 0, 0]),
        loss_mask=np.array([1, 1, 0, 1, 0, 0, 1, 1], np.uint8),
        step_ends=np.array([2, 4, 8]),
        step_rewards=np.array([1.0, 0.0, 1.0], np.float32),
        group_id=7,
    ).validate()


def _single(reward: float = 0.0, group: int = 7, steps: list[float] | None = None) -> Sample:
    """A single-turn sample of 3 actions, one step (or ``len(steps)`` steps of whole tokens, the last the rest)."""
    ends = None if steps is None or len(steps) == 1 else np.array([*range(1, len(steps)), 3])
    return Sample(
        prompt_ids=np.array([5], np.int32),
        response_ids=np.array([30, 31, 32], np.int32),
        behaviour_logprobs=np.full(3, -1.0, np.float32),
        versions=np.zeros(3, np.int64),
        step_ends=ends,
        step_rewards=None if steps is None else np.array(steps, np.float32),
        group_id=group,
        reward=reward,
    ).validate()


def _loss(rule: str, weight: float = 1.0, std_normalize: bool = True) -> LossConfig:
    return LossConfig(std_normalize=std_normalize, credit=CreditConfig(rule=rule, weight=weight))


# Group 7: the agent's step rewards [1, 0, 1] and the single-turn sample's [0]; pooled [1, 0, 1, 0]: mean 0.5, std 0.5.
# Normalised: [1, -1, 1] and [-1] (std_normalize off: centred only, [0.5, -0.5, 0.5] and [-0.5]).
# sum: [1, 0, 1] and [-1] (off: [0.5, 0, 0.5] and [-0.5]); min: [-1, -1, 1] and [-1].
# Per action (the agent's steps [0, 0, 1, 2, 2]), outcome advantages 0.25 and -0.25:
@pytest.mark.parametrize(
    "rule, weight, std_normalize, agent, single",
    [
        ("sum", 0.5, True, [0.75, 0.75, 0.25, 0.75, 0.75], [-0.75] * 3),
        ("sum", 2.0, False, [1.25, 1.25, 0.25, 1.25, 1.25], [-1.25] * 3),
        ("min", 1.0, True, [-0.75, -0.75, -0.75, 1.25, 1.25], [-1.25] * 3),
        ("min", 1.0, False, [-0.25, -0.25, -0.25, 0.75, 0.75], [-0.75] * 3),
        ("sum", 0.0, True, [0.25] * 5, [-0.25] * 3),  # weight 0: the outcome alone
        ("outcome", 1.0, True, [0.25] * 5, [-0.25] * 3),
    ],
)
def test_process_advantages_on_hand_computed_values(rule, weight, std_normalize, agent, single):
    samples = [_agent(), _single(steps=[0.0])]
    got = process_advantages(samples, np.array([0.25, -0.25], np.float32), _loss(rule, weight, std_normalize))
    assert [g.dtype for g in got] == [np.float32, np.float32] and [len(g) for g in got] == [5, 3]
    # 1e-6 of the std (0.5) in the divisor
    np.testing.assert_allclose(got[0], agent, rtol=0, atol=4e-6)
    np.testing.assert_allclose(got[1], single, rtol=0, atol=4e-6)


def test_groups_normalise_apart_and_equal_step_rewards_leave_the_outcome():
    # group 3: every step scored 0.5: normalised 0 exactly, so each action takes its outcome advantage
    samples = [_agent(), _single(steps=[0.0]), _single(group=3, steps=[0.5, 0.5]), _single(group=3, steps=[0.5])]
    outcome = np.array([0.25, -0.25, 1.0, -1.0], np.float32)
    got = process_advantages(samples, outcome, _loss("sum", 0.5))
    np.testing.assert_allclose(got[0], [0.75, 0.75, 0.25, 0.75, 0.75], atol=4e-6)  # as without group 3
    assert got[2].tolist() == [1.0] * 3 and got[3].tolist() == [-1.0] * 3
    # a plugin rule: halved sums
    plugin = process_advantages(samples, outcome, _loss("tests.trainer.test_credit:halved_later", 1.0))
    np.testing.assert_allclose(plugin[0], [0.75, 0.75, 0.25, 0.75, 0.75], atol=4e-6)


def test_a_process_rule_refuses_samples_without_step_rewards_and_outcome_reads_none():
    samples = [_agent(), _single(), _single(group=3, steps=[1.0]), _single(group=4)]
    outcome = np.zeros(4, np.float32)
    expected = (
        "2 sample(s) carry no step rewards (at [1, 3], of groups [4, 7]): trainer.loss.credit.rule=min needs step "
        "rewards (a process reward model reward.process.model, a reward function returning step scores, or an "
        "environment scoring turns)"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        process_advantages(samples, outcome, _loss("min"))
    got = process_advantages(samples, np.array([1, 2, 3, 4], np.float32), _loss("outcome"))
    assert [g.tolist() for g in got] == [[1.0] * 5, [2.0] * 3, [3.0] * 3, [4.0] * 3]


def test_a_rule_giving_the_wrong_shape_is_named():
    with pytest.raises(ValueError, match=r"credit.rule=tests.trainer.test_credit:one_value gave shape \(1,\)"):
        process_advantages([_agent()], np.zeros(1), _loss("tests.trainer.test_credit:one_value"))


def one_value(step_values: np.ndarray) -> np.ndarray:
    return step_values[:1]


# ---- the config ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "values, named",
    [
        ({"rule": "nope"}, "trainer.loss.credit.rule='nope': expected one of outcome, sum, min"),
        ({"rule": "tests.trainer.test_credit:NOT_A_RULE"}, "trainer.loss.credit.rule=.* is int, not a function"),
        ({"rule": "tests.trainer.nowhere:rule"}, "trainer.loss.credit.rule=.* cannot be loaded"),
        ({"weight": -0.5}, "trainer.loss.credit.weight must be >= 0, got -0.5"),
        ({"weight": float("nan")}, "trainer.loss.credit.weight must be >= 0, got nan"),
    ],
)
def test_a_bad_credit_config_names_the_key(values, named):
    with pytest.raises(ConfigError, match=named):
        CreditConfig(**values)


def test_the_credit_section_loads_from_the_jobs_keys():
    from moerl.orchestrator.config import load_config

    loaded = load_config(None, ["trainer.loss.credit.rule=min", "trainer.loss.credit.weight=0.5"]).trainer.loss.credit
    assert loaded == CreditConfig(rule="min", weight=0.5) and loaded.process
    assert not LossConfig().credit.process and LossConfig().credit == CreditConfig("outcome", 1.0)
    plugin = CreditConfig(rule="tests.trainer.test_credit:halved_later")
    assert plugin.process and CREDITS.load(plugin.rule) is halved_later
    with pytest.raises(ConfigError, match="trainer.loss.credit.weight"):
        load_config(None, ["trainer.loss.credit.weight=-1"])


# ---- the micro-batch and the wire ------------------------------------------------------------------------------------
@pytest.mark.parametrize("packed", [False, True])
def test_a_micro_batch_takes_each_actions_advantage(packed):
    samples = [_agent(), _single(), _single()]
    per_action = np.array([0.5, -0.5, 1.0, 2.0, 3.0], np.float32)
    # per-action advantages, one value, and one value for a sample that shares its prompt with the one before it
    mb = build_micro_batch(
        samples,
        [per_action, -0.25, 0.75],
        [1.0] * 3,
        1,
        use_masks=False,
        routed_experts=None,
        packed=packed,
        shared=[0, 0, 1] if packed else None,
    )
    assert mb.advantages.dtype == torch.float32
    assert mb.advantages.tolist() == [0.5, -0.5, 1.0, 2.0, 3.0, -0.25, -0.25, -0.25, 0.75, 0.75, 0.75]
    with pytest.raises(ValueError):  # an advantage per action, or one for all
        build_micro_batch(samples[:1], [per_action[:3]], [1.0], 1, use_masks=False, routed_experts=None)


def _episodes(step_rewards: bool = True, shared: bool = False) -> list[Sample]:
    """Two groups of two: agent episodes (a step per turn, the context after a turn in its step) and single-turn
    samples of one step or several; rewards differ within each group. ``shared``: a group's samples share its prompt."""
    rng = np.random.default_rng(21)
    shapes = [(4, [(3, 2), (2, 0)]), (4, [(5, 0)]), (3, [(2, 3), (1, 1), (2, 0)]), (3, [(4, 0)])]
    scores = [[0.9, 0.1], [0.4], [0.2, 1.0, 0.6], [0.3]]
    samples = []
    for i, ((p, turns), r) in enumerate(zip(shapes, [1.0, 0.0, 0.25, 0.75], strict=True)):
        s = stream(rng, p, turns, reward=r, group=i // 2)
        # transformers' embedding gives its pad id (0) no gradient, megatron-core's does: leave it out
        s.prompt_ids, s.response_ids = (np.maximum(ids, 1) for ids in (s.prompt_ids, s.response_ids))
        if shared and i % 2:
            s.prompt_ids = samples[-1].prompt_ids.copy()
        s.step_ends = np.cumsum([m + c for m, c in turns]) if len(turns) > 1 else None
        s.step_rewards = np.array(scores[i], np.float32) if step_rewards else None
        if i == 1:  # a single-turn response cut into steps by text: 3 steps
            s.step_ends, s.step_rewards = np.array([1, 3, 5]), np.array([0.5, 0.0, 0.7], np.float32)
        samples.append(s.validate())
    return samples


def _credit_config(rule: str = "sum", weight: float = 0.5, shared: bool = False, **train) -> TrainerConfig:
    return TrainerConfig(
        loss=LossConfig(correction="none", credit=CreditConfig(rule=rule, weight=weight)),
        replay=ReplayConfig(routing="off", sampling_mask=False),
        micro_batch_format="packed" if shared else "padded",
        shared_prompt=shared,
        **train,
    )


def _expected(samples: list[Sample], cfg: TrainerConfig) -> list[np.ndarray]:
    outcome = grpo_advantages(
        np.array([s.reward for s in samples]), np.array([s.group_id for s in samples]), cfg.loss.std_normalize
    )
    return process_advantages(samples, outcome, cfg.loss)


def _payload(samples: list[Sample], needs: Needs, advantages: list[np.ndarray] | None):
    prompt, response, kept, actions = _lengths(samples)
    skips = np.zeros(len(samples), np.int64)
    fields = _fields(needs, prompt, response, kept, actions, None, False, skips, None, advantages is not None)
    buffer = _pack(samples, needs, fields, False, skips, advantages)
    return fields, buffer, _token_advantages(buffer, fields, actions)


def test_the_wire_carries_each_actions_advantage_to_the_last_stage_alone():
    samples = _episodes()
    sent = _expected(samples, _credit_config())
    last, first = Needs(0, ids=True, last=True, columns=()), Needs(0, ids=True, last=False, columns=())
    fields, buffer, got = _payload(samples, last, sent)
    assert "advantages" in [f[0] for f in fields] and got is not None
    assert all(g.dtype == np.float32 and np.array_equal(g, s) for g, s in zip(got, sent, strict=True))
    outcome_fields, outcome_buffer, none = _payload(samples, last, None)
    assert none is None and "advantages" not in [f[0] for f in outcome_fields]
    # an outcome-only payload is today's: the fields and bytes of a call that knows nothing of process credit
    today = _fields(last, *_lengths(samples), None, False, np.zeros(4, np.int64), None)
    assert outcome_fields == today and len(outcome_buffer) == _spans(today)[1]
    tokens = sum(s.action_count for s in samples)
    assert len(buffer) - len(outcome_buffer) == -(-4 * tokens // 8) * 8  # a float per action, 8-byte aligned
    first_fields, first_buffer, nothing = _payload(samples, first, sent)  # the first stage reads no loss
    assert [f[0] for f in first_fields] == ["ids"] and nothing is None


def _lengths(samples: list[Sample]) -> tuple[np.ndarray, ...]:
    prompt, response, actions = (
        np.array([getattr(s, a) for s in samples]) for a in ("prompt_len", "response_len", "action_count")
    )
    return prompt, response, np.zeros(len(samples), np.int64), actions


def scatter_outcome_and_process(outcome_cfg, process_cfg, lacking: list, samples: list, layout: Layout) -> dict:
    """A bare distributor (no model) at ``layout``: what rank 0's plan of ``lacking`` says under ``process_cfg``
    (every rank is told it failed), then what this rank receives of ``samples`` under each config."""
    from megatron.core import parallel_state

    from moerl.megatron.parallel import init_distributed
    from moerl.trainer.distribute import BatchDistributor, LocalInstalment
    from tests.workers import refusal

    init_distributed(layout)
    rank0 = torch.distributed.get_rank() == 0
    out: dict = {}
    for name, cfg in (("outcome", outcome_cfg), ("process", process_cfg)):
        batches = BatchDistributor(cfg, columns=[])
        out["needs"] = batches.needs
        if name == "process":
            out["refused"] = refusal(batches, lacking)
        local = batches.scatter(samples if rank0 else None)
        assert isinstance(local, LocalInstalment), "rank 0 sent an instalment"
        out[name] = {
            "received": local.received,
            "advantages": local.advantages,
            "token_advantages": local.token_advantages,
            "per_sample": [local.advantage(i) for i in range(len(local.samples))],
            "responses": [s.response_ids for s in local.samples],
        }
    out["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    return out


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout, shared", [(Layout(pp=2), False), (Layout(tp=2, pp=2), True)], ids=["DP2xPP2", "TP2xPP2"]
)
def test_the_distributor_sends_each_actions_advantage_to_the_last_stage(layout, shared):
    """No model: rank 0's plan refuses an instalment one sample of which has no step rewards and tells every rank; the
    next instalment's per-action advantages reach each last-stage rank (both TP peers) as rank 0 computed them, with its
    shard; first-stage ranks receive no more than an outcome-only run sends them, last-stage ones a float per action
    more."""
    samples = _episodes(shared=shared)
    lacking = [*samples[:3], Sample(**{**samples[3].__dict__, "step_rewards": None})]
    outcome_cfg, process_cfg = _credit_config("outcome", shared=shared), _credit_config("sum", shared=shared)
    ranks = run_ranks(scatter_outcome_and_process, 4, outcome_cfg, process_cfg, lacking, samples, layout)
    assert "1 sample(s) carry no step rewards (at [3], of groups [1])" in ranks[0]["refused"]
    assert all(out["refused"] == "told" for out in ranks[1:])
    expected = _expected(samples, process_cfg)
    dp = 4 // (layout.tp * layout.pp)
    shards = shard_by_tokens([s.fed_len for s in samples], dp)  # DP1: the whole instalment
    assert sorted(out["needs"].last for out in ranks) == [False, False, True, True]
    for out in ranks:
        mine = shards[out["needs"].dp_rank]
        outcome, process = out["outcome"], out["process"]
        assert all(np.array_equal(r, samples[i].response_ids) for r, i in zip(process["responses"], mine, strict=True))
        np.testing.assert_array_equal(process["advantages"], outcome["advantages"])  # the plan's: the outcome's
        assert outcome["token_advantages"] is None
        assert all(isinstance(a, float) for a in outcome["per_sample"])
        if not out["needs"].last:
            assert process["token_advantages"] is None and process["received"] == outcome["received"]
            continue
        got = process["token_advantages"]
        assert len(got) == len(mine)
        for g, i in zip(got, mine, strict=True):
            assert g.dtype == np.float32 and np.array_equal(g, expected[i])
        assert all(np.array_equal(a, g) for a, g in zip(process["per_sample"], got, strict=True))
        tokens = sum(samples[i].action_count for i in mine)
        assert process["received"] - outcome["received"] == -(-4 * tokens // 8) * 8
    assert sorted(out["tp_rank"] for out in ranks) == ([0, 0, 1, 1] if layout.tp == 2 else [0] * 4)
    assert _HEADER == 6  # the flag travels in the header's flags: no slot more


# ---- trainer steps ---------------------------------------------------------------------------------------------------
def step(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """One trainer step on ``samples`` (given on rank 0): its metrics and the full gradients it applied."""
    from moerl.trainer.trainer import Trainer
    from tests.workers import full_tensors

    trainer = Trainer(mcore_dir, trainer_cfg)
    metrics = trainer.step(samples if torch.distributed.get_rank() == 0 else None)
    return {"metrics": metrics, "grads": full_tensors(trainer.model.module, grads=True)}


@pytest.mark.e2e
def test_equal_step_rewards_train_as_the_outcome_alone(tiny_ckpts):
    """PP2, several micro-batches: every step of a group scored alike normalises to 0, so rule sum gives each action
    its outcome advantage: the loss and the gradient are the outcome-only run's, bit for bit."""
    _, mcore_dir = tiny_ckpts[ARCH]
    samples = _episodes()
    for s in samples:
        s.step_rewards = np.full(len(s.steps), 0.5 * (1 + s.group_id), np.float32)
    train = {"pp": 2, "micro_batch_tokens": 32, "optim": OptimConfig(lr=1e-3)}
    process = run_ranks(step, 2, str(mcore_dir), _credit_config("sum", 2.0, **train), samples)[0]
    outcome = run_ranks(step, 2, str(mcore_dir), _credit_config("outcome", **train), samples)[0]
    assert process["metrics"]["train/loss"] == outcome["metrics"]["train/loss"] != 0
    assert process["grads"].keys() == outcome["grads"].keys()
    for name, g in outcome["grads"].items():
        assert torch.equal(process["grads"][name], g), name


@pytest.mark.e2e
@pytest.mark.parametrize(
    "world, train",
    [(1, {"micro_batch_tokens": 32}), (2, {"pp": 2, "shared": True})],
    ids=["padded", "PP2 packed shared prompt"],
)
def test_step_values_reach_the_loss_per_action(tiny_ckpts, world, train):
    """Rule sum over step rewards that differ, correction none, token mean: at ratio 1 the loss is minus the mean of
    the per-action advantages (written out here from DeepSeekMath's formula), and the gradient is transformers' of
    -sum_t A_t log p_t over the actions, token-mean."""
    from tests.conftest import assert_hf_grads
    from tests.trainer.test_distill import hf_logprobs

    hf_dir, mcore_dir = tiny_ckpts[ARCH]
    shared = train.pop("shared", False)
    samples = _episodes(shared=shared)
    weight = 0.5
    cfg = _credit_config("sum", weight, shared=shared, optim=OptimConfig(lr=1e-3, clip_grad=1e9), **train)
    out = run_ranks(step, world, str(mcore_dir), cfg, samples)[0]

    # DeepSeekMath (arXiv 2402.03300, 4.1.3): r~ = (r - mean R) / std R over the group's step rewards, A_t = the sum of
    # r~ over the steps ending at or after t; the outcome advantage beside it
    outcome = grpo_advantages(np.array([s.reward for s in samples]), np.array([s.group_id for s in samples]), True)
    advantages = []
    for i, s in enumerate(samples):
        pooled = np.concatenate([t.step_rewards for t in samples if t.group_id == s.group_id]).astype(np.float64)
        normalised = (s.step_rewards - pooled.mean()) / (pooled.std() + EPS)
        later = np.array([normalised[k:].sum() for k in range(len(normalised))])
        step_of = np.searchsorted(s.steps, np.arange(s.response_len), side="right")
        advantages.append(torch.from_numpy(outcome[i] + weight * later[step_of]).float())
    per_action = torch.cat([a[torch.from_numpy(s.actions)] for a, s in zip(advantages, samples, strict=True)])
    assert len(set(per_action.tolist())) > 4  # the advantage varies along the responses
    metrics = out["metrics"]
    assert metrics["train/loss"] == pytest.approx(-per_action.mean().item(), rel=1e-5)
    if shared:  # each group's prompt fed once
        assert metrics["train/tokens_fed"] == sum(s.fed_len for s in samples) - 4 - 3

    logps, model = hf_logprobs(hf_dir, samples, grad=True)
    count = len(per_action)
    loss = 0.0
    for s, logp, a in zip(samples, logps, advantages, strict=True):
        actions = torch.from_numpy(s.actions)
        student = logp.gather(1, torch.from_numpy(s.response_ids).long()[:, None])[:, 0]
        loss = loss - (a * student)[actions].sum() / count
    loss.backward()
    assert_hf_grads(out["grads"], model)
