"""Objectives and corrections against values computed by hand on small tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moerl.errors import ConfigError
from moerl.trainer import objectives
from moerl.trainer.objectives import LossConfig

T = torch.tensor


def test_grpo_advantages_centre_and_scale_each_group():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 5.0, 3.0])
    groups = np.array([0, 0, 0, 0, 1, 1])
    adv = objectives.grpo_advantages(rewards, groups, std_normalize=True, eps=0.0)
    std0 = math.sqrt(0.75 * 0.25)  # group 0: mean 0.75, population std
    np.testing.assert_allclose(adv, [0.25 / std0, -0.75 / std0, 0.25 / std0, 0.25 / std0, 1.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(
        objectives.grpo_advantages(rewards, groups, std_normalize=False), [0.25, -0.75, 0.25, 0.25, 1.0, -1.0]
    )


def test_aggregation_weights():
    lengths = np.array([2, 4])
    np.testing.assert_allclose(objectives.aggregation_weights(lengths, "token_mean"), [1 / 6, 1 / 6])
    np.testing.assert_allclose(objectives.aggregation_weights(lengths, "seq_mean_token_mean"), [1 / 4, 1 / 8])
    np.testing.assert_allclose(objectives.aggregation_weights(lengths, "seq_mean_token_sum_norm", 10), [1 / 20, 1 / 20])
    np.testing.assert_allclose(objectives.aggregation_weights(lengths, "seq_mean_token_sum_norm"), [1 / 8, 1 / 8])


def test_ppo_clip_and_dual_clip():
    cfg = LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.3, dual_clip=3.0)
    ratios = [0.5, 1.1, 1.5, 5.0, 0.5]
    adv = T([1.0, 1.0, 1.0, -1.0, -1.0])
    new, old = T([math.log(r) for r in ratios]), torch.zeros(5)
    terms, clipped = objectives.policy_terms(new, old, adv, torch.zeros(5, dtype=torch.long), 1, cfg)
    # A>0: max(-r, -clip(r)) -> r=0.5: -0.5 (unclipped is larger); r=1.1: -1.1; r=1.5: -1.3 (clipped).
    # A<0: max(r, clip(r)) -> r=5: 5, capped by dual clip at 3; r=0.5: max(0.5, 0.8) = 0.8 (clipped).
    np.testing.assert_allclose(terms.numpy(), [-0.5, -1.1, -1.3, 3.0, 0.8], rtol=1e-6)
    assert clipped.tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]


def test_ppo_gradient_vanishes_where_clipped():
    cfg = LossConfig(policy_loss="ppo", clip_low=0.2, clip_high=0.2, dual_clip=None)
    new = T([math.log(1.5), math.log(1.1)], requires_grad=True)
    terms, _ = objectives.policy_terms(new, torch.zeros(2), T([1.0, 1.0]), torch.zeros(2, dtype=torch.long), 1, cfg)
    terms.sum().backward()
    np.testing.assert_allclose(new.grad.numpy(), [0.0, -1.1], rtol=1e-6)  # d(-r)/dlogr = -r


def test_gspo_uses_the_length_normalised_sequence_ratio():
    cfg = LossConfig(policy_loss="gspo", clip_low=0.5, clip_high=0.5)
    new = T([0.2, 0.4, -0.3], requires_grad=True)
    old = T([0.0, 0.0, 0.0])
    seq = T([0, 0, 1])
    adv = T([1.0, 1.0, 2.0])
    terms, _ = objectives.policy_terms(new, old, adv, seq, 2, cfg)
    s0, s1 = math.exp(0.3), math.exp(-0.3)  # mean log-ratio per sequence
    np.testing.assert_allclose(terms.detach().numpy(), [-s0, -s0, -2 * s1], rtol=1e-6)
    terms.sum().backward()
    # d/dnew_t of -A * s_i * exp(new_t - sg(new_t)) = -A * s_i
    np.testing.assert_allclose(new.grad.numpy(), [-s0, -s0, -2 * s1], rtol=1e-6)


def test_cispo_keeps_gradients_of_clipped_tokens_with_a_capped_weight():
    cfg = LossConfig(policy_loss="cispo", clip_high=0.2)
    new = T([math.log(2.0), math.log(0.5)], requires_grad=True)
    adv = T([1.0, -1.0])
    terms, clipped = objectives.policy_terms(new, torch.zeros(2), adv, torch.zeros(2, dtype=torch.long), 1, cfg)
    terms.sum().backward()
    np.testing.assert_allclose(new.grad.numpy(), [-1.2, 0.5], rtol=1e-6)  # -A * min(r, 1.2)
    assert clipped.tolist() == [1.0, 0.0]


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("none", [1.0, 1.0, 1.0]),
        ("tis", [math.exp(0.5), math.exp(0.3), math.exp(-1.0)]),  # exp(old - behaviour), under the cap of 2
        # IcePop: k = old/behaviour where k lies in [0.5, 2], else 0 (e^-1 < 0.5 is zeroed).
        ("icepop", [math.exp(0.5), math.exp(0.3), 0.0]),
        ("token_mask", [1.0, 1.0, 0.0]),  # the same band, kept tokens unweighted
        ("seq_is", [2.0, 2.0, math.exp(-1.0)]),  # exp(0.5 + 0.3) > 2 is capped; sequence 1 alone
        ("geo_is", [math.exp(0.4), math.exp(0.4), math.exp(-1.0)]),  # exp(mean over the sequence)
    ],
)
def test_behaviour_to_proximal_corrections(kind, expected):
    cfg = LossConfig(correction=kind, is_cap=2.0, band_low=0.5, band_high=2.0)
    old = T([0.0, 0.0, 0.0])
    behaviour = T([-0.5, -0.3, 1.0])
    w = objectives.correction(old, behaviour, T([0, 0, 1]), 2, cfg)
    np.testing.assert_allclose(w.numpy(), expected, rtol=1e-6)


def test_kl_estimators():
    new, ref = T([0.0, -1.0]), T([-0.5, -0.5])
    np.testing.assert_allclose(objectives.kl_terms(new, ref, "k1").numpy(), [0.5, -0.5])
    np.testing.assert_allclose(
        objectives.kl_terms(new, ref, "k3").numpy(), [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1], rtol=1e-6
    )


def test_bad_loss_config_names_the_field():
    with pytest.raises(ConfigError, match="loss.policy_loss='grpo'"):
        LossConfig(policy_loss="grpo")
    with pytest.raises(ConfigError, match="loss.correction='math:pi' is float, not a function"):
        LossConfig(correction="math:pi")
    with pytest.raises(ConfigError, match="loss.aggregation='math:floor' is builtin_function_or_method, not an Agg"):
        LossConfig(aggregation="math:floor")
    with pytest.raises(ConfigError, match="loss.dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ConfigError, match="loss.band_low"):
        LossConfig(band_low=2.0, band_high=0.5)


def test_icepop_band_edges_are_inclusive():
    low, high = 0.5, 2.0
    behaviour = -T([math.log(low), math.log(high), math.log(high) + 1e-3])
    w = objectives.correction(
        torch.zeros(3),
        behaviour,
        torch.zeros(3, dtype=torch.long),
        1,
        LossConfig(correction="icepop", band_low=low, band_high=high),
    )
    np.testing.assert_allclose(w.numpy(), [low, high, 0.0], rtol=1e-5)


EXTREME = [50.0, -50.0, 0.0, 50.0, -50.0]  # log-ratios of badly stale or mismatched tokens
ADV = [1.0, 1.0, 0.0, -1.0, -1.0]


@pytest.mark.parametrize("policy_loss", objectives.POLICY_LOSSES.names)
def test_extreme_policy_ratios_give_finite_losses_and_gradients(policy_loss):
    cfg = LossConfig(policy_loss=policy_loss, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    new = T(EXTREME, requires_grad=True)
    terms, _ = objectives.policy_terms(new, torch.zeros(5), T(ADV), T([0, 1, 2, 3, 4]), 5, cfg)
    terms.sum().backward()
    assert torch.isfinite(terms).all() and torch.isfinite(new.grad).all()
    e20, e10 = math.exp(20.0), math.exp(10.0)
    expected = {
        # verl: ratio = exp(clamp(log r, -20, 20)); PPO with dual clip 3 for negative advantages.
        "ppo": [-1.28, -math.exp(-20.0), 0.0, 3.0, 0.8],
        # verl: the sequence log-ratio (here one token per sequence) is clamped at 10, from above only.
        "gspo": [-1.28, -math.exp(-50.0), 0.0, e10, 0.8],
        # CISPO: -A * min(r, 1 + clip_high) * log pi_new.
        "cispo": [-1.28 * 50.0, -math.exp(-20.0) * -50.0, 0.0, 1.28 * 50.0, math.exp(-20.0) * -50.0],
    }[policy_loss]
    np.testing.assert_allclose(terms.detach().numpy(), expected, rtol=1e-5, atol=1e-12)
    assert e20 > 1e8  # the bound itself stays finite in fp32


@pytest.mark.parametrize("kind", objectives.CORRECTIONS.names)
def test_extreme_behaviour_ratios_give_finite_corrections(kind):
    old = T(EXTREME)
    w = objectives.correction(old, torch.zeros(5), T([0, 0, 1, 2, 2]), 3, LossConfig(correction=kind))
    assert torch.isfinite(w).all() and (w >= 0).all()
    if kind in ("icepop", "token_mask"):
        assert w[[0, 1, 3, 4]].eq(0).all() and w[2] == 1.0  # far outside the band: no weight at all


def test_extreme_kl_is_clamped_like_verl():
    new = T(EXTREME, requires_grad=True)
    kl = objectives.kl_terms(new, torch.zeros(5), "k3")
    kl.sum().backward()
    # log r = ref - new clamped to +-20, then k3 = r - log r - 1 clamped to 10.
    np.testing.assert_allclose(kl.detach().numpy(), [10.0, 10.0, 0.0, 10.0, 10.0])
    assert torch.isfinite(new.grad).all()
    assert torch.isfinite(objectives.kl_terms(new, torch.zeros(5), "k1")).all()


def test_tis_truncates_at_the_cap():
    w = objectives.correction(T([0.0, 0.0]), T([-1.0, -0.2]), T([0, 0]), 1, LossConfig(correction="tis", is_cap=2.0))
    np.testing.assert_allclose(w.numpy(), [2.0, math.exp(0.2)], rtol=1e-6)


def halved_tis(log_w, seq, num_seqs, cfg):
    """A user's correction, loaded by name as a plugin is."""
    return objectives.truncated_is(log_w, seq, num_seqs, cfg) / 2


def test_a_plugin_objective_is_loaded_by_its_module_path():
    cfg = LossConfig(correction=f"{__name__}:halved_tis", is_cap=2.0)
    w = objectives.correction(T([0.0, 0.0]), T([-1.0, -0.2]), T([0, 0]), 1, cfg)
    np.testing.assert_allclose(w.numpy(), [1.0, math.exp(0.2) / 2], rtol=1e-6)
