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
    with pytest.raises(ConfigError, match="loss.geo_band_low must be >= 0 and below geo_band_high"):
        LossConfig(correction="geo_mask", geo_band_low=1.001, geo_band_high=0.999)
    with pytest.raises(ConfigError, match="loss.k3_bound must be > 0"):
        LossConfig(correction="k3_mask", k3_bound=0.0)
    for veto in (0.0, 1.0, -1e-4):
        with pytest.raises(ConfigError, match="loss.veto_below must be in"):
            LossConfig(correction="seq_mask", veto_below=veto)
    for kind in objectives.TOKEN_CORRECTIONS:
        with pytest.raises(ConfigError, match=f"applies to the sequence-level corrections.*correction='{kind}'"):
            LossConfig(correction=kind, veto_below=1e-4)


def test_new_correction_fields_default_to_no_change():
    cfg = LossConfig()
    assert cfg.veto_below is None and cfg.correction == "tis"
    assert (cfg.band_low, cfg.band_high, cfg.is_cap) == (0.5, 2.0, 2.0)
    assert (cfg.geo_band_low, cfg.geo_band_high, cfg.k3_bound) == (0.999, 1.001, 0.01)  # verl's Geo-RS, K3-RS


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
    if kind not in objectives.TOKEN_CORRECTIONS:
        # Samples 0 and 2 hold e^50 and e^-50, which cancel in their product and mean; the veto rejects them.
        vetoed = objectives.correction(
            old, torch.zeros(5), T([0, 0, 1, 2, 2]), 3, LossConfig(correction=kind, veto_below=1e-4)
        )
        assert vetoed[[0, 1, 3, 4]].eq(0).all() and vetoed[2] == w[2]


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


# --- Sequence-level rejection (slime's MIS, verl's Seq-MIS / Geo-RS / K3-RS) -----------------------------------------


def _flat(seqs):
    """Per-sample log-ratios (old - behaviour) as the flat log_w [T] and seq [T] the corrections take."""
    log_w = T([x for s in seqs for x in s], dtype=torch.float64)
    seq = T([i for i, s in enumerate(seqs) for _ in s])
    return log_w, seq


def _weights(seqs, **cfg):
    log_w, seq = _flat(seqs)
    # old - behaviour = log_w
    w = objectives.correction(log_w, torch.zeros_like(log_w), seq, len(seqs), LossConfig(**cfg))
    return [w[seq == i].tolist() for i in range(len(seqs))]


def test_seq_mask_keeps_in_band_sequences_weighted_by_their_truncated_ratio():
    seqs = [
        [0.2, 0.1],  # product e^0.3 = 1.35 in [0.5, 2]: kept, weighted by it
        [0.4, 0.3],  # e^0.7 = 2.01 > 2: rejected
        [-0.5, -0.3],  # e^-0.8 = 0.45 < 0.5: rejected
        [0.6],  # e^0.6 = 1.82 in band: kept, its weight truncated at is_cap = 1.5
        [math.log(2.0)],  # the band's edges are in it, as IcePop's
        [math.log(0.25), math.log(2.0)],
    ]
    w = _weights(seqs, correction="seq_mask", band_low=0.5, band_high=2.0, is_cap=1.5)
    expected = [[math.exp(0.3)] * 2, [0.0] * 2, [0.0] * 2, [1.5], [1.5], [0.5] * 2]
    for got, want in zip(w, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_geo_mask_rejects_sequences_whose_geometric_mean_leaves_the_band():
    seqs = [
        [0.0005, 0.0003],  # mean 0.0004: e^0.0004 in [0.999, 1.001], kept unweighted
        [0.002, 0.0002],  # mean 0.0011: above 1.001, rejected
        [-0.003, 0.0],  # mean -0.0015: below 0.999, rejected
        [0.5, -0.5],  # mean 0: kept, though each token is far off (what the veto, or k3_mask, is for)
    ]
    w = _weights(seqs, correction="geo_mask")  # the default band [0.999, 1.001], verl's Geo-RS
    assert w == [[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]


def test_k3_mask_rejects_sequences_whose_mean_k3_exceeds_the_bound():
    def k3(x):
        return math.exp(x) - x - 1

    seqs = [[0.1, -0.1], [0.2, 0.0], [-0.14], [0.5, -0.5]]
    means = [sum(map(k3, s)) / len(s) for s in seqs]
    assert means[0] < 0.01 < means[1] and means[2] < 0.01 < means[3]  # 0.0050, 0.0107, 0.0094, 0.1276
    w = _weights(seqs, correction="k3_mask", k3_bound=0.01)
    assert w == [[1.0, 1.0], [0.0, 0.0], [1.0], [0.0, 0.0]]


@pytest.mark.parametrize(
    "kind, vetoed_seq",
    [
        ("seq_is", [-10.0, 10.0]),  # product and mean 1: weight 1 without the veto
        ("geo_is", [-10.0, 10.0]),
        ("seq_mask", [-10.0, 10.0]),
        ("geo_mask", [-10.0, 10.0]),
        ("k3_mask", [-10.0] + [0.0] * 1000),  # mean k3 = 9.00005 / 1001 < 0.01: kept without the veto
    ],
)
def test_veto_rejects_a_sequence_holding_one_catastrophic_token(kind, vetoed_seq):
    # e^-10 = 4.5e-5 < 1e-4: vetoed; 2e-4 (log -8.5) is above the threshold: not.
    seqs = [vetoed_seq, [0.1, -0.1], [math.log(2e-4), -math.log(2e-4)]]
    free = _weights(seqs, correction=kind)
    assert all(x > 0 for x in free[0])
    vetoed = _weights(seqs, correction=kind, veto_below=1e-4)
    assert all(x == 0 for x in vetoed[0])
    assert vetoed[1:] == free[1:]  # the veto touches no other sequence


# Peer checks: slime's examples/train_infer_mismatch_helper/mis.py (compute_mis_weights) and verl's
# verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_correction_and_rejection_mask), each re-derived here from
# their documented formulas on their own layouts (slime: a list of per-sequence tensors; verl: padded [B, L] with a
# response mask), in float64, and compared with ours on the flat layout.
SAFETY = 20.0


def _random_batch(seed, scale, num=64, veto_frac=0.0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 17, (num,), generator=g).tolist()
    train, rollout = [], []
    for n in lengths:
        rollout.append(-torch.rand(n, generator=g, dtype=torch.float64) * 3)
        d = torch.randn(n, generator=g, dtype=torch.float64) * scale
        if veto_frac:
            d = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < veto_frac, -12.0, d)
        train.append(rollout[-1] + d)
    return train, rollout


def _ours(train, rollout, **cfg):
    old, behaviour = torch.cat(train), torch.cat(rollout)
    seq = torch.cat([torch.full((len(t),), i) for i, t in enumerate(train)])
    w = objectives.correction(old, behaviour, seq, len(train), LossConfig(**cfg))
    return [w[seq == i] for i in range(len(train))]


def _slime(train, rollout, level, mode, upper, rs_low, rs_high, veto):
    """slime's per-token weight times its rejection mask (the rejected tokens leave only the numerator) for
    use_tis=use_rs=True, tis_level=rs_level=level: log r = train - rollout summed (sequence) or averaged (geometric),
    clamped to +-20, exponentiated; truncate mode min(w, upper), mask mode w itself; the rejection keeps
    rs_low <= w <= rs_high; the veto drops a sequence with any raw token log r < log(veto)."""
    out = []
    for t, r in zip(train, rollout, strict=True):
        d = t - r
        agg = d.sum() if level == "sequence" else d.mean()
        w = torch.exp(agg.clamp(-SAFETY, SAFETY))
        weight = torch.clamp(w, 0, upper) if mode == "truncate" else w
        keep = float(rs_low <= w <= rs_high)
        if veto is not None and (d < math.log(veto)).any():
            keep = 0.0
        out.append((weight * keep).expand(len(d)))
    return out


def _pad(xs):
    width = max(len(x) for x in xs)
    out = torch.zeros(len(xs), width, dtype=torch.float64)
    mask = torch.zeros(len(xs), width, dtype=torch.float64)
    for i, x in enumerate(xs):
        out[i, : len(x)], mask[i, : len(x)] = x, 1.0
    return out, mask


def _verl(train, rollout, rollout_is, is_threshold, rollout_rs, low, high):
    """verl's IS weight times its rejection mask: log r = old - rollout; rollout_is "sequence": exp(clamp(sum log r,
    +-20)) truncated at is_threshold, None: 1; with c = clamp(log r, +-20), per token k1 = -c, k3 = exp(c) - 1 - c;
    seq_sum_k1 / seq_mean_k1 keep log(low) <= stat <= log(high), seq_mean_k3 keeps stat <= high."""
    old, mask = _pad(train)
    roll, _ = _pad(rollout)
    log_r = (old - roll) * mask
    n = mask.sum(-1)
    if rollout_is == "sequence":
        weight = torch.exp(log_r.sum(-1).clamp(-SAFETY, SAFETY)).clamp(max=is_threshold)
    else:
        weight = torch.ones(len(train), dtype=torch.float64)
    safe = log_r.clamp(-SAFETY, SAFETY)
    k1, k3 = -safe, torch.exp(safe) - 1 - safe
    if rollout_rs == "seq_sum_k1":
        stat = (k1 * mask).sum(-1)
        keep = (stat >= math.log(low)) & (stat <= math.log(high))
    elif rollout_rs == "seq_mean_k1":
        stat = (k1 * mask).sum(-1) / n
        keep = (stat >= math.log(low)) & (stat <= math.log(high))
    else:  # seq_mean_k3
        keep = (k3 * mask).sum(-1) / n <= high
    per_token = (weight * keep)[:, None] * mask
    return [per_token[i, : len(t)] for i, t in enumerate(train)]


def _compare(ours, theirs):
    kept = sum(bool(w.gt(0).all()) for w in theirs)
    assert 0 < kept < len(theirs), f"the batch should hold kept and rejected sequences, {kept}/{len(theirs)} kept"
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seq_mask_matches_slime_mis(seed):
    train, rollout = _random_batch(seed, scale=0.15, veto_frac=0.02)
    cfg = dict(correction="seq_mask", band_low=0.5, band_high=2.0, veto_below=1e-4)
    # truncate mode: min(w, upper) kept where rs_low <= w <= rs_high (our is_cap, band)
    _compare(
        _ours(train, rollout, is_cap=1.5, **cfg), _slime(train, rollout, "sequence", "truncate", 1.5, 0.5, 2.0, 1e-4)
    )
    # mask mode (MIS proper): w itself where in band, which our truncation leaves alone when is_cap >= band_high
    _compare(_ours(train, rollout, is_cap=2.0, **cfg), _slime(train, rollout, "sequence", "mask", 2.0, 0.5, 2.0, 1e-4))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_geo_mask_and_veto_match_slime(seed):
    train, rollout = _random_batch(seed, scale=0.002, veto_frac=0.02)
    # geo_mask is slime's geometric rejection mask alone (its weight 1: compare with the weight of a flat 1)
    theirs = _slime(train, rollout, "geometric", "mask", 2.0, 0.999, 1.001, 1e-4)
    ones = [w.gt(0).double() for w in theirs]
    _compare(_ours(train, rollout, correction="geo_mask", veto_below=1e-4), ones)
    # seq_is with the veto: slime's sequence TIS with a rejection band that rejects nothing but the veto's
    train, rollout = _random_batch(seed, scale=0.15, veto_frac=0.02)
    theirs = _slime(train, rollout, "sequence", "truncate", 2.0, 0.0, 1e30, 1e-4)
    _compare(_ours(train, rollout, correction="seq_is", is_cap=2.0, veto_below=1e-4), theirs)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seq_mask_geo_mask_k3_mask_match_verl_presets(seed):
    # verl bounds k1 = -log r, so its [low, high] is ours reflected: the two agree for a band with low = 1 / high,
    # as verl's presets (0.5_2.0 for Seq-MIS) and its default lower bound (1 / upper) are.
    train, rollout = _random_batch(seed, scale=0.15)
    # Seq-MIS: rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0"
    _compare(
        _ours(train, rollout, correction="seq_mask", band_low=0.5, band_high=2.0, is_cap=2.0),
        _verl(train, rollout, "sequence", 2.0, "seq_sum_k1", 0.5, 2.0),
    )
    # K3-RS: rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01
    _compare(
        _ours(train, rollout, correction="k3_mask", k3_bound=0.01),
        _verl(train, rollout, None, 2.0, "seq_mean_k3", 0, 0.01),
    )
    # Geo-RS: rollout_is=None, rollout_rs="seq_mean_k1" (preset 0.999_1.001; here its symmetric form)
    train, rollout = _random_batch(seed, scale=0.002)
    _compare(
        _ours(train, rollout, correction="geo_mask", geo_band_low=1 / 1.001, geo_band_high=1.001),
        _verl(train, rollout, None, 2.0, "seq_mean_k1", 1 / 1.001, 1.001),
    )
