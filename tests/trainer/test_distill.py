"""On-policy distillation, the trainer's side: the teacher's k1 reverse KL as a per-token advantage (slime's OPD
advantage on the same tensors), the top-k reverse KL against a direct softmax over gathered logits, full-vocabulary
log-probs at given ids on one rank and across TP shards, the micro-batch and the wire carrying the teacher to the loss's
stage alone, the plan refusing an instalment without it, and trainer steps: a teacher that is the student is at KL 0, a
pure-distillation step trains on the teacher alone (the gradient transformers gives for it) while every reward is
equal."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moerl.errors import ConfigError
from moerl.megatron.launch import run_ranks
from moerl.sample import Sample
from moerl.trainer.batch import build_micro_batch, shard_by_tokens
from moerl.trainer.config import OptimConfig, ReplayConfig, TrainerConfig
from moerl.trainer.distribute import BatchDistributor, Needs, _fields, _pack, _unpack
from moerl.trainer.logprobs import full_logprobs, logprobs_at
from moerl.trainer.objectives import DistillConfig, LossConfig, distill_advantages, topk_reverse_kl
from tests.trainer.test_loss_mask import stream

ARCH = "Qwen3MoeForCausalLM"
VOCAB = 256  # the tiny models'
CARRIED_K, TOP_K = 6, 4  # the samples carry more top-k columns than the loss reads
T = torch.tensor


def with_teacher(sample: Sample, logp: torch.Tensor, noise: np.ndarray | None = None) -> Sample:
    """``sample`` with a teacher whose full-vocabulary log-probs at its response tokens are ``logp`` [R, V]: its
    log-prob of each action (plus ``noise``), over the action's kept set where there is one, and its top
    CARRIED_K; context rows 0.0 (ids 0), as the contract holds them."""
    actions = torch.from_numpy(sample.actions)
    at = lambda x: torch.where(actions.reshape(-1, *[1] * (x.dim() - 1)), x, torch.zeros_like(x))
    tokens = torch.from_numpy(sample.response_ids).long()
    full = logp.gather(1, tokens[:, None])[:, 0]
    if noise is not None:
        full = full + torch.from_numpy(noise).float()
    sample.teacher_logprobs = at(full).numpy().astype(np.float32)
    if sample.mask_offsets is not None:
        offsets, ids = sample.mask_offsets, torch.from_numpy(sample.mask_ids).long()
        norm = torch.stack([logp[t, ids[offsets[t] : offsets[t + 1]]].logsumexp(0) for t in range(len(tokens))])
        sample.teacher_selected_logprobs = at(full - norm).numpy().astype(np.float32)
    top = logp.topk(CARRIED_K, dim=1)
    sample.teacher_top_ids = at(top.indices).numpy().astype(np.int32)
    sample.teacher_top_logprobs = at(top.values).numpy().astype(np.float32)
    return sample.validate()


def random_teacher(sample: Sample, seed: int) -> Sample:
    """A teacher of random full-vocabulary log-probs (for what does not run a model)."""
    g = torch.Generator().manual_seed(seed)
    return with_teacher(sample, torch.log_softmax(torch.randn(sample.response_len, VOCAB, generator=g) * 2, -1))


def hf_logprobs(hf_dir, samples: list[Sample], grad: bool = False) -> tuple[list[torch.Tensor], object]:
    """Per sample, transformers' full-vocabulary log-probs [R, V] at its response positions (the trainer's own, in
    fp32), and the model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = []
    with torch.set_grad_enabled(grad):
        for s in samples:
            logits = model(torch.from_numpy(s.fed_ids().astype(np.int64))[None]).logits[0, s.prompt_len - 1 :]
            out.append(torch.log_softmax(logits / s.temperature, -1))
    return out, model


# ---- the objective -------------------------------------------------------------------------------------------------
def slime_opd_advantages(advantages, student_logp, teacher_logp, kl_coef):
    """slime's on-policy distillation: the reward's advantage minus kl_coef times the student's log-ratio to the
    teacher (written here from its formula, A_t - lambda * (log p_student - log p_teacher))."""
    return advantages - kl_coef * (student_logp - teacher_logp)


def test_the_distillation_advantage_is_slimes_opd_advantage():
    g = torch.Generator().manual_seed(0)
    adv, student, teacher = torch.randn(12, generator=g), -3 * torch.rand(12, generator=g), -3 * torch.rand(12)
    got = distill_advantages(adv, student, teacher, DistillConfig(coef=0.7))
    torch.testing.assert_close(got, slime_opd_advantages(adv, student, teacher, 0.7), rtol=0, atol=1e-6)
    # pure distillation; a weighted reward
    torch.testing.assert_close(
        distill_advantages(adv, student, teacher, DistillConfig(coef=0.7, reward_weight=0.0)),
        slime_opd_advantages(torch.zeros(12), student, teacher, 0.7),
    )
    torch.testing.assert_close(
        distill_advantages(adv, student, teacher, DistillConfig(coef=0.7, reward_weight=0.5)),
        slime_opd_advantages(0.5 * adv, student, teacher, 0.7),
    )
    # a constant for the policy loss, even from a student log-prob with gradient
    assert not distill_advantages(
        adv, student.clone().requires_grad_(True), teacher, DistillConfig(coef=1)
    ).requires_grad
    # no teacher (distillation off): the reward's alone; a teacher that excludes a token: finite, the log-ratio at 20
    torch.testing.assert_close(distill_advantages(adv, student, None, DistillConfig()), adv)
    extreme = distill_advantages(T([0.5, 0.5]), T([-1.0, -1.0]), T([-math.inf, -1e30]), DistillConfig(coef=0.1))
    torch.testing.assert_close(extreme, T([0.5 - 2.0, 0.5 - 2.0]))


def test_the_top_k_reverse_kl_is_the_kl_of_the_softmax_over_the_gathered_logits():
    g = torch.Generator().manual_seed(1)
    tokens, k = 9, 5
    logits = torch.randn(tokens, VOCAB, generator=g, dtype=torch.float64) * 3
    teacher_logits = torch.randn(tokens, VOCAB, generator=g, dtype=torch.float64) * 3
    ids = torch.stack([torch.randperm(VOCAB, generator=g)[:k] for _ in range(tokens)])
    teacher_top = torch.log_softmax(teacher_logits, -1).gather(1, ids)  # what a teacher reports: full-vocab log-probs
    upstream = torch.linspace(-1.0, 2.0, tokens, dtype=torch.float64)

    reference_logits = logits.clone().requires_grad_(True)
    q_s = torch.softmax(reference_logits.gather(1, ids), -1)
    q_t = torch.softmax(teacher_logits.gather(1, ids), -1)
    reference = (q_s * (q_s.log() - q_t.log())).sum(-1)
    (upstream * reference).sum().backward()

    student_logits = logits.clone().requires_grad_(True)
    got = topk_reverse_kl(logprobs_at(student_logits, ids), teacher_top)
    (upstream * got).sum().backward()
    torch.testing.assert_close(got.detach(), reference.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(student_logits.grad, reference_logits.grad, rtol=0, atol=1e-12)
    assert (got > 0).all()
    # the student as its own teacher: KL 0 and no gradient (the minimum)
    same = logits.clone().requires_grad_(True)
    kl = topk_reverse_kl(logprobs_at(same, ids), torch.log_softmax(logits, -1).gather(1, ids))
    kl.sum().backward()
    assert kl.abs().max() < 1e-12 and same.grad.abs().max() < 1e-12


def test_logprobs_at_is_the_log_softmax_gathered_and_its_gradient_is_exact():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, VOCAB, generator=g, dtype=torch.float64) * 4
    ids = torch.randint(0, VOCAB, (7, 3), generator=g)
    torch.testing.assert_close(
        logprobs_at(logits, ids), torch.log_softmax(logits, -1).gather(1, ids), rtol=0, atol=1e-12
    )
    targets = ids[:, 0]
    assert torch.equal(full_logprobs(logits, targets), logprobs_at(logits, targets[:, None])[:, 0])
    small = logits[:, :24].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: logprobs_at(z, ids % 24), (small,), eps=1e-6, atol=1e-7)


@pytest.mark.e2e
def test_logprobs_at_across_tp_shards_matches_the_dense_reference():
    from tests.trainer.distill_workers import shard_logprobs_at

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 48, generator=g) * 3
    logits[:, 23:25] = 200.0  # each shard's edge far above the rest: an id read outside its shard must not leak
    ids = torch.tensor([[0, 23, 24, 47], [1, 2, 3, 4], [30, 31, 40, 47], [23, 24, 0, 0], [5, 40, 10, 45], [7, 7, 7, 7]])
    upstream = torch.linspace(-1.0, 2.0, 24).reshape(6, 4)
    dense = logits.clone().requires_grad_(True)
    reference = torch.log_softmax(dense, -1).gather(1, ids)
    (upstream * reference).sum().backward()
    ranks = run_ranks(shard_logprobs_at, 2, logits, ids, upstream)
    for out in ranks:
        torch.testing.assert_close(out["logprobs"], reference.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=1), dense.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "values, named",
    [
        ({"coef": -0.1}, "loss.distill.coef must be >= 0"),
        ({"reward_weight": -1.0}, "loss.distill.reward_weight must be >= 0"),
        ({"top_k": -2}, "loss.distill.top_k must be >= 0"),
        ({"top_k": 4}, "loss.distill.top_k and top_k_coef come together"),
        ({"top_k_coef": 0.1}, "loss.distill.top_k and top_k_coef come together"),
        ({"reward_weight": 0.0}, "loss.distill.reward_weight=0 leaves nothing to learn from without a teacher"),
    ],
)
def test_a_bad_distill_config_names_the_field(values, named):
    with pytest.raises(ConfigError, match=named):
        DistillConfig(**values)


def test_the_distill_section_loads_from_the_jobs_keys():
    from moerl.orchestrator.config import load_config

    loaded = load_config(
        None,
        [
            "teacher.model=/models/teacher",
            "trainer.loss.distill.coef=0.5",
            "trainer.loss.distill.top_k=4",
            "trainer.loss.distill.top_k_coef=0.1",
        ],
    ).trainer.loss.distill
    assert loaded == DistillConfig(coef=0.5, top_k=4, top_k_coef=0.1) and loaded.enabled
    assert not LossConfig().distill.enabled and DistillConfig(top_k=2, top_k_coef=1.0).enabled
    with pytest.raises(ConfigError, match="loss.distill.coef"):
        load_config(None, ["trainer.loss.distill.coef=-1"])


# ---- the micro-batch and the wire ----------------------------------------------------------------------------------
def _samples(kept: bool) -> list[Sample]:
    rng = np.random.default_rng(4)
    shapes = [(3, [(2, 3), (1, 4), (2, 0)]), (2, [(5, 0)]), (4, [(1, 6), (3, 1)])]  # one single-turn sample
    return [
        random_teacher(stream(rng, p, turns, reward=float(i), kept=kept), seed=i) for i, (p, turns) in enumerate(shapes)
    ]


@pytest.mark.parametrize("masks", [True, False])
def test_a_micro_batch_carries_the_teacher_of_its_actions(masks):
    samples = _samples(kept=True)
    build = lambda k: build_micro_batch(
        samples, [0.0] * 3, [1.0] * 3, 1, use_masks=masks, routed_experts=None, teacher_top_k=k
    )
    mb = build(TOP_K)
    teacher = [s.teacher_selected_logprobs if masks else s.teacher_logprobs for s in samples]
    expected = np.concatenate([s.at_actions(t) for s, t in zip(samples, teacher, strict=True)])
    assert mb.teacher.dtype == torch.float32 and np.array_equal(mb.teacher.numpy(), expected)
    top_ids = np.concatenate([s.at_actions(s.teacher_top_ids)[:, :TOP_K] for s in samples])
    assert mb.teacher_top_ids.shape == (mb.num_tokens, TOP_K) and np.array_equal(mb.teacher_top_ids.numpy(), top_ids)
    top = np.concatenate([s.at_actions(s.teacher_top_logprobs)[:, :TOP_K] for s in samples])
    assert np.array_equal(mb.teacher_top_logprobs.numpy(), top)
    only = build(0)
    assert np.array_equal(only.teacher.numpy(), expected) and only.teacher_top_ids is None
    none = build(None)
    assert none.teacher is None and none.teacher_top_ids is None and none.teacher_top_logprobs is None


def _round_trip(samples: list[Sample], needs: Needs, masks: bool, teacher: int | None) -> tuple[list[str], int, list]:
    prompt, response, actions = (
        np.array([getattr(s, attr) for s in samples]) for attr in ("prompt_len", "response_len", "action_count")
    )
    kept = np.array([len(s.mask_ids) if masks else 0 for s in samples])
    skips = np.zeros(len(samples), dtype=np.int64)
    fields = _fields(needs, prompt, response, kept, actions, None, masks, skips, teacher)
    buffer = _pack(samples, needs, fields, masks, skips)
    temperature = np.array([s.temperature for s in samples])
    return [f[0] for f in fields], len(buffer), _unpack(buffer, fields, prompt, response, temperature, actions, skips)


@pytest.mark.parametrize("masks", [True, False])
def test_the_wire_carries_the_teacher_of_the_actions_to_the_last_stage(masks):
    samples = _samples(kept=masks)
    last = Needs(dp_rank=0, ids=True, last=True, columns=())
    names, nbytes, got = _round_trip(samples, last, masks, TOP_K)
    assert {"teacher", "teacher_top_ids", "teacher_top_logprobs"} <= set(names)
    for g, s in zip(got, samples, strict=True):
        sent = s.teacher_selected_logprobs if masks else s.teacher_logprobs
        assert np.array_equal(g.teacher_logprobs, sent)  # context rows 0.0 on arrival, as sent
        assert (g.teacher_selected_logprobs is not None) == masks
        assert np.array_equal(g.teacher_top_ids, s.teacher_top_ids[:, :TOP_K])  # the first top_k columns only
        assert np.array_equal(g.teacher_top_logprobs, s.teacher_top_logprobs[:, :TOP_K])
        g.validate()
    tokens = sum(s.action_count for s in samples)
    _, without, _ = _round_trip(samples, last, masks, None)
    # the teacher's bytes: a float per action, then k ids and k floats; each field 8-byte aligned
    assert nbytes - without == sum(-(-n // 8) * 8 for n in (4 * tokens, 4 * tokens * TOP_K, 4 * tokens * TOP_K))
    names, _, got = _round_trip(samples, last, masks, 0)
    assert "teacher" in names and "teacher_top_ids" not in names and got[0].teacher_top_ids is None
    # the first stage feeds, reading no loss: no teacher
    names, _, got = _round_trip(samples, Needs(dp_rank=0, ids=True, last=False, columns=()), masks, TOP_K)
    assert names == ["ids"] and all(g.teacher_logprobs is None for g in got)


def _config(masks: bool = True, **distill) -> TrainerConfig:
    return TrainerConfig(
        loss=LossConfig(distill=DistillConfig(**distill)), replay=ReplayConfig(routing="off", sampling_mask=masks)
    )


@pytest.mark.parametrize(
    "masks, drop, named",
    [
        (False, "teacher_logprobs", "1 sample(s) carry no teacher_logprobs"),
        (True, "teacher_selected_logprobs", "1 sample(s) carry no teacher_selected_logprobs"),
        (False, "teacher_top_ids", f"1 sample(s) carry no teacher_top_ids with >= {TOP_K} columns"),
        (False, "narrow", f"2 sample(s) carry no teacher_top_ids with >= {CARRIED_K + 1} columns"),
    ],
)
def test_the_plan_refuses_an_instalment_whose_samples_lack_what_distillation_reads(masks, drop, named):
    samples = _samples(kept=True)
    top_k = CARRIED_K + 1 if drop == "narrow" else TOP_K
    if drop == "teacher_logprobs":
        samples[1].teacher_logprobs = samples[1].teacher_selected_logprobs = None
        samples[1].teacher_top_ids = samples[1].teacher_top_logprobs = None
    elif drop == "teacher_top_ids":
        samples[2].teacher_top_ids = samples[2].teacher_top_logprobs = None
    elif drop != "narrow":
        setattr(samples[0], drop, None)
    if drop == "narrow":
        samples[0].teacher_top_ids = np.repeat(samples[0].teacher_top_ids, 2, axis=1)
        samples[0].teacher_top_logprobs = np.repeat(samples[0].teacher_top_logprobs, 2, axis=1)
    planner = SimpleNamespace(cfg=_config(masks, coef=1.0, top_k=top_k, top_k_coef=0.1))
    with pytest.raises(ValueError, match=re.escape(f"distillation is on (trainer.loss.distill) but {named}")):
        BatchDistributor._teacher(planner, samples, masks)
    # off, nothing is read of the teacher; on, whole samples plan their top-k
    assert BatchDistributor._teacher(SimpleNamespace(cfg=_config(masks)), samples, masks) is None
    if drop != "narrow":
        assert BatchDistributor._teacher(planner, _samples(kept=True), masks) == TOP_K


@pytest.mark.e2e
def test_the_distributor_sends_the_teacher_to_the_last_stage_and_refuses_an_instalment_without_it():
    """DP2 x PP2, no model: rank 0's plan refuses an instalment one sample of which has no teacher top-k and tells every
    rank; the next instalment's teacher reaches each last-stage rank with its shard (kept-set log-probs, the first
    top_k columns), and no first-stage rank."""
    from tests.trainer.distill_workers import scatter_with_and_without_teacher

    samples = _samples(kept=True) + [random_teacher(stream(np.random.default_rng(9), 2, [(3, 0)], kept=True), 9)]
    lacking = [*samples[:3], Sample(**{**samples[3].__dict__, "teacher_top_ids": None, "teacher_top_logprobs": None})]
    cfg = _config(True, coef=1.0, top_k=TOP_K, top_k_coef=0.1)
    ranks = run_ranks(scatter_with_and_without_teacher, 4, cfg, lacking, samples, 2)
    assert "1 sample(s) carry no teacher_top_ids" in ranks[0]["refused"]
    assert all(out["refused"] == "told" for out in ranks[1:])
    shards = shard_by_tokens([s.fed_len for s in samples], 2)
    assert sorted(out["needs"].last for out in ranks) == [False, False, True, True]
    for out in ranks:
        mine = [samples[i] for i in shards[out["needs"].dp_rank]]
        for got, sent in zip(out["samples"], mine, strict=True):
            if not out["needs"].last:
                assert got.teacher_logprobs is None and got.teacher_top_ids is None
                continue
            assert np.array_equal(got.teacher_selected_logprobs, sent.teacher_selected_logprobs)
            assert np.array_equal(got.teacher_top_ids, sent.teacher_top_ids[:, :TOP_K])
            assert np.array_equal(got.teacher_top_logprobs, sent.teacher_top_logprobs[:, :TOP_K])


# ---- trainer steps ---------------------------------------------------------------------------------------------------
def _episodes(rewards: list[float], kept: bool) -> list[Sample]:
    rng = np.random.default_rng(11)
    shapes = [(4, [(3, 4), (3, 0)]), (3, [(5, 0)]), (5, [(2, 3), (2, 0)]), (2, [(4, 0)])]
    return [
        stream(rng, p, turns, reward=r, group=i // 2, kept=kept)
        for i, ((p, turns), r) in enumerate(zip(shapes, rewards, strict=True))
    ]


@pytest.mark.e2e
def test_a_teacher_that_is_the_student_is_at_reverse_kl_zero(tiny_ckpts):
    """PP2, kept sets: the teacher's log-probs are transformers' of the same model (over each kept set, its top-k
    over the whole vocabulary): the k1 reverse KL and the top-k KL the step reports are 0, the teacher's mean log-prob
    is the samples'."""
    from tests.trainer.distill_workers import step_with_teacher

    hf_dir, mcore_dir = tiny_ckpts[ARCH]
    samples = _episodes([1.0, 0.0, 0.5, 0.25], kept=True)
    logps, _ = hf_logprobs(hf_dir, samples)
    samples = [with_teacher(s, logp) for s, logp in zip(samples, logps, strict=True)]
    cfg = TrainerConfig(
        pp=2,
        loss=LossConfig(distill=DistillConfig(coef=1.0, top_k=TOP_K, top_k_coef=0.5)),
        replay=ReplayConfig(routing="off", sampling_mask=True),
        optim=OptimConfig(lr=1e-3),
    )
    metrics = run_ranks(step_with_teacher, 2, str(mcore_dir), cfg, samples)[0]["metrics"]
    teacher = np.concatenate([s.at_actions(s.teacher_selected_logprobs) for s in samples])
    assert abs(metrics["distill/reverse_kl"]) < 1e-4
    assert abs(metrics["distill/topk_kl"]) < 1e-7  # at 0 a KL rounds to either side
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(teacher.mean(), rel=1e-6)
    assert metrics["train/tokens"] == len(teacher) and math.isfinite(metrics["train/loss"])
    assert metrics["train/grad_norm"] > 0  # the rewards differ


@pytest.mark.e2e
def test_pure_distillation_trains_on_the_teacher_while_every_reward_is_equal(tiny_ckpts):
    """reward_weight 0, every reward equal (GRPO's advantage 0), a teacher off the student by known noise: at ratio 1
    the loss is coef times the k1 reverse KL, which is minus the noise's mean, and the gradient is transformers' of
    -coef * (teacher - student) * log p over the actions, token-mean."""
    from tests.conftest import assert_hf_grads
    from tests.trainer.distill_workers import step_with_teacher

    hf_dir, mcore_dir = tiny_ckpts[ARCH]
    samples = _episodes([1.0] * 4, kept=False)
    logps, model = hf_logprobs(hf_dir, samples, grad=True)
    rng = np.random.default_rng(12)
    noises = [np.where(s.actions, rng.normal(0.0, 0.5, s.response_len), 0.0) for s in samples]
    samples = [with_teacher(s, lp.detach(), n) for s, lp, n in zip(samples, logps, noises, strict=True)]
    coef = 0.5
    cfg = TrainerConfig(
        micro_batch_tokens=32,  # several micro-batches
        loss=LossConfig(correction="none", distill=DistillConfig(coef=coef, reward_weight=0.0)),
        replay=ReplayConfig(routing="off", sampling_mask=False),
        optim=OptimConfig(lr=1e-3, clip_grad=1e9),
    )
    out = run_ranks(step_with_teacher, 1, str(mcore_dir), cfg, samples)[0]
    metrics = out["metrics"]
    noise = np.concatenate([s.at_actions(n) for s, n in zip(samples, noises, strict=True)])
    assert metrics["distill/reverse_kl"] == pytest.approx(-noise.mean(), abs=1e-4)
    assert metrics["train/loss"] == pytest.approx(coef * metrics["distill/reverse_kl"], rel=1e-5)
    assert "distill/topk_kl" not in metrics and metrics["train/grad_norm"] > 0

    count = len(noise)
    loss = 0.0
    for s, logp in zip(samples, logps, strict=True):
        actions = torch.from_numpy(s.actions)
        student = logp.gather(1, torch.from_numpy(s.response_ids).long()[:, None])[:, 0]
        advantage = coef * (torch.from_numpy(s.teacher_logprobs) - student.detach())
        loss = loss - (advantage * student)[actions].sum() / count
    loss.backward()
    assert_hf_grads(out["grads"], model)
