"""Response lengths in simulation profiles: siblings' correlation as configured, the job's record of every finished
group's lengths, and a profile calibrated from such records (``moerl calibrate-lengths``)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import zmq

from moerl.errors import ConfigError
from moerl.simulation import (
    LENGTHS_FILE,
    Z99,
    CalibrationError,
    LengthRecord,
    Profile,
    ResponseLengths,
    fit_response_lengths,
    read_lengths,
)
from tests import DATA

PROFILE = DATA / "simulation" / "tiny.yaml"


def sibling_logs(lengths: ResponseLengths, prompts: int, siblings: int, seed: int) -> np.ndarray:
    """[prompts, siblings] log-lengths the model gives random prompts, each sampled with ``siblings`` random seeds."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(prompts):
        prompt = rng.integers(0, 150_000, 64)
        rows.append([math.log(lengths.tokens(prompt, int(s))) for s in rng.integers(-(2**63), 2**63 - 1, siblings)])
    return np.array(rows)


def balanced_icc(logs: np.ndarray) -> float:
    """The one-way ANOVA intra-class correlation of equal groups (rows)."""
    g, k = logs.shape
    between = k * logs.mean(axis=1).var(ddof=1)
    within = logs.var(axis=1, ddof=1).mean()
    return (between - within) / (between + (k - 1) * within)


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
def test_siblings_lengths_have_the_configured_correlation_and_marginal(rho):
    lengths = ResponseLengths(median=40, p99=200, correlation=rho)
    g, k = 2000, 8
    logs = sibling_logs(lengths, g, k, seed=11)
    # The estimator's standard error for equal groups (Donner & Koval 1980); 4 of them, so a fixed seed that passes
    # is no accident, and a model off by a few hundredths fails.
    se = math.sqrt(2 * (1 - rho) ** 2 * (1 + (k - 1) * rho) ** 2 / (k * (k - 1) * (g - 1)))
    assert abs(balanced_icc(logs) - rho) < 4 * se, (balanced_icc(logs), rho, se)
    # The marginal stays the configured log-normal: its quantiles' standard errors on the samples' effective count.
    effective = g * k / (1 + (k - 1) * rho)
    sigma = lengths.sigma
    se_median = 1.2533 * sigma / math.sqrt(effective)
    se_p99 = math.sqrt(0.01 * 0.99) / (math.exp(-(Z99**2) / 2) / math.sqrt(2 * math.pi)) * sigma / math.sqrt(effective)
    assert abs(np.median(logs) - math.log(40)) < 4 * se_median
    assert abs(np.quantile(logs, 0.99) - math.log(200)) < 4 * se_p99


@pytest.mark.parametrize("rho", [0.0, 0.73])
def test_a_prompts_groups_of_two_epochs_share_its_difficulty_alone(rho):
    """The offline model's draw of a prompt's group in successive epochs: the log-lengths of two responses, within an
    epoch or across two, correlate by rho; the first epoch's group is the one draw_group makes from the same state."""
    lengths = ResponseLengths(median=40, p99=200, correlation=rho)
    g, k = 2000, 4
    rng = np.random.default_rng(5)
    epochs = np.log(np.stack([lengths.draw_epochs(rng, k, 2) for _ in range(g)]))  # [prompt, epoch, sample]
    assert np.array_equal(
        lengths.draw_epochs(np.random.default_rng(1), k, 2)[0], lengths.draw_group(np.random.default_rng(1), k)
    )
    # across epochs: one response of each, k pairs a prompt; Fisher's z, its standard error over g prompts
    across = np.corrcoef(epochs[:, 0, :].ravel(), epochs[:, 1, :].ravel())[0, 1]
    assert abs(math.atanh(across) - math.atanh(rho)) < 4 / math.sqrt(g - 3), (across, rho)
    se = math.sqrt(2 * (1 - rho) ** 2 * (1 + (2 * k - 1) * rho) ** 2 / (2 * k * (2 * k - 1) * (g - 1)))
    assert abs(balanced_icc(epochs.reshape(g, 2 * k)) - rho) < 4 * se  # the two epochs' 2k responses, one class


def test_a_length_is_a_function_of_the_prompt_and_the_seed_alone():
    lengths = ResponseLengths(median=40, p99=200, correlation=0.5)
    prompt = list(range(100, 130))
    assert lengths.tokens(prompt, 7) == lengths.tokens(np.array(prompt), 7)  # in every process: a hash, no state
    assert lengths.tokens(prompt, 7) != lengths.tokens(prompt, 8) != lengths.tokens(prompt[1:], 8)
    # The correlation alone moves it: rho 0 is the sample's own draw, whatever the prompt.
    independent = ResponseLengths(median=40, p99=200)
    assert independent.tokens(prompt, 7) == independent.tokens([1, 2, 3], 7)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, "high"])
def test_a_correlation_outside_0_1_is_one_error_naming_it(tmp_path, bad):
    path = tmp_path / "bad.yaml"
    path.write_text(
        PROFILE.read_text().replace("{median: 40, p99: 200}", f"{{median: 40, p99: 200, correlation: {bad}}}")
    )
    with pytest.raises(ConfigError, match=r"engine\.response_tokens") as err:
        Profile.load(path)
    assert "correlation" in str(err.value) and str(err.value).count(";") == 0  # one problem, said once
    # Only response lengths take one: an episode's turns are not a prompt's siblings.
    path.write_text(
        PROFILE.read_text().replace("turns: {median: 3, p99: 6}", "turns: {median: 3, p99: 6, correlation: 0.5}")
    )
    with pytest.raises(ConfigError, match=r"episodes\.turns\.correlation"):
        Profile.load(path)


# ---- calibration --------------------------------------------------------------------------------------------------
def synthetic(lengths: ResponseLengths, groups: int, siblings: int, cap: int, seed: int = 3) -> list[LengthRecord]:
    """Groups drawn from the model as the simulated engine draws them (rounded up), cut at ``cap`` as a run cuts."""
    out = []
    for index, row in enumerate(sibling_logs(lengths, groups, siblings, seed)):
        drawn = [math.ceil(math.exp(v)) for v in row]
        out.append(LengthRecord(index, [min(n, cap) for n in drawn], [n >= cap for n in drawn], cap))
    return out


@pytest.mark.parametrize("rho", [0.0, 0.5, 0.9])
@pytest.mark.parametrize("cap", [100_000, 100])  # none cut; about 10% cut
def test_calibration_recovers_the_models_figures_with_and_without_truncation(rho, cap):
    truth = ResponseLengths(median=40, p99=200, correlation=rho)
    g, k = 400, 8
    fit = fit_response_lengths(synthetic(truth, g, k, cap))
    assert (fit.groups, fit.samples) == (g, k * g)
    assert (fit.truncated == 0) if cap > 1000 else (0.05 < fit.truncated < 0.15)
    effective = g * k / (1 + (k - 1) * rho)
    se_mu = truth.sigma / math.sqrt(effective)  # of the mean of the logs, which the fit's median is
    assert abs(math.log(fit.lengths.median / 40)) < 4 * se_mu + 0.01
    se_p99 = math.sqrt(se_mu**2 + Z99**2 * truth.sigma**2 / (2 * effective))  # mu + Z99 sigma's
    assert abs(math.log(fit.lengths.p99 / 200)) < 4 * se_p99 + 0.01
    se_rho = math.sqrt(2 * (1 - rho) ** 2 * (1 + (k - 1) * rho) ** 2 / (k * (k - 1) * (g - 1)))
    assert abs(fit.lengths.correlation - rho) < 4 * se_rho + (0.03 if cap < 1000 else 0), fit.lengths


def test_calibration_counts_truncated_responses_as_longer_not_as_their_cap():
    truth = ResponseLengths(median=40, p99=200)
    groups = synthetic(truth, 300, 8, 60)  # about a quarter cut at 60 tokens
    fit = fit_response_lengths(groups)
    assert 0.2 < fit.truncated < 0.35
    naive = fit_response_lengths([LengthRecord(g.group, g.lengths, [False] * 8, 60) for g in groups])
    assert abs(math.log(fit.lengths.p99 / 200)) < 0.15 < abs(math.log(naive.lengths.p99 / 200))


def test_calibration_refuses_too_few_groups_and_mostly_truncated_responses():
    truth = ResponseLengths(median=40, p99=200, correlation=0.5)
    with pytest.raises(CalibrationError, match="7 groups of two responses or more.*at least 8"):
        fit_response_lengths(synthetic(truth, 7, 8, 1000))
    single = [LengthRecord(i, [40], [False], 100) for i in range(20)]  # one response each: no siblings to correlate
    with pytest.raises(CalibrationError, match="0 groups"):
        fit_response_lengths(single)
    agentic = [
        LengthRecord(g.group, g.lengths, g.truncated, 1000, episodes=True) for g in synthetic(truth, 20, 4, 1000)
    ]
    with pytest.raises(CalibrationError, match="agentic ones left out"):
        fit_response_lengths(agentic)
    with pytest.raises(CalibrationError, match=r"stopped at their cap.*rollout\.max_new_tokens"):
        fit_response_lengths(synthetic(truth, 40, 8, 30))


def write_run(run_dir, groups: list[LengthRecord]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / LENGTHS_FILE, "a") as f:
        f.writelines(g.line() + "\n" for g in groups)


def test_the_command_writes_a_profile_that_loads_with_the_fitted_lengths(tmp_path, capsys):
    from moerl.cli.calibrate_lengths import main

    truth = ResponseLengths(median=40, p99=200, correlation=0.6)
    groups = synthetic(truth, 240, 8, 100)
    write_run(tmp_path / "a", groups[:120])
    write_run(tmp_path / "b", groups[120:])
    base = tmp_path / "profiles" / "base.yaml"  # with a model relative to it, which the new profile keeps finding
    base.parent.mkdir()
    base.write_text("model: ../model\n" + PROFILE.read_text())
    out = tmp_path / "elsewhere" / "new.yaml"
    out.parent.mkdir()
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--profile", str(base), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    written, before = Profile.load(out), Profile.load(base)
    fitted = fit_response_lengths(groups)
    assert written.engine.response_tokens == fitted.lengths
    assert abs(written.engine.response_tokens.correlation - 0.6) < 0.1
    assert written.model == before.model and written.trainer == before.trainer and written.episodes == before.episodes
    assert written.engine.decode_tokens_per_s == before.engine.decode_tokens_per_s
    assert written.sources[:-1] == before.sources and "240 groups (1920 responses" in written.sources[-1]
    for figure in ("groups 240, samples 1920", f"median {fitted.lengths.median:g}", "correlation", "truncated"):
        assert figure in report, report

    write_run(tmp_path / "few", groups[:5])
    assert main([str(tmp_path / "few"), "--profile", str(base), "--out", str(tmp_path / "x.yaml")]) == 2
    assert "error: 5 groups" in capsys.readouterr().out and not (tmp_path / "x.yaml").exists()
    assert main([str(tmp_path / "none"), "--profile", str(base), "--out", str(tmp_path / "x.yaml")]) == 2
    assert f"{LENGTHS_FILE} not found" in capsys.readouterr().out


# ---- the job's record ---------------------------------------------------------------------------------------------
def group_done(index: int, lengths: list[int], reasons: list[str], version: int = 5, episodes: bool = False):
    from moerl.orchestrator.messages import GroupDone
    from moerl.sample import Sample

    samples = [
        Sample(
            prompt_ids=np.arange(4, dtype=np.int32),
            response_ids=np.ones(n, np.int32),
            behaviour_logprobs=np.zeros(n, np.float32),
            versions=np.full(n, version, np.int64),
            finish_reason=reason,
            group_id=index,
        )
        for n, reason in zip(lengths, reasons, strict=True)
    ]
    return GroupDone(index, samples, episodes={"episode/episodes": 2.0} if episodes else None)


def test_the_buffer_records_every_group_as_it_arrives_and_a_resumed_run_appends(tmp_path):
    """Stale groups too: the long ones a step drops are the tail a calibration needs."""
    from moerl.orchestrator.config import RolloutSection
    from moerl.orchestrator.messages import Issued
    from moerl.orchestrator.rollouts import Outcome, RolloutBuffer

    ctx = zmq.Context()
    manager = ctx.socket(zmq.PULL)  # where the buffer's orders go
    buffer = RolloutBuffer(ctx, RolloutSection(groups_per_step=1, max_new_tokens=64), "async", run_dir=tmp_path)
    manager.connect(buffer.orders_address)
    try:
        for index in range(3):
            buffer._handle(Issued(index, new=True))
        buffer._handle(group_done(0, [64, 9], ["length", "stop"], version=1))  # 4 versions old at version 5: stale
        buffer._handle(group_done(1, [3, 5, 7], ["stop"] * 3))
        buffer._handle(group_done(2, [30, 12], ["stop", "length"], episodes=True))
        assert len((tmp_path / LENGTHS_FILE).read_text().splitlines()) == 3  # flushed as each came
        (taken,) = buffer.instalments(version=5, groups=1, whole=True)
        assert [g.index for g in taken] == [1] and buffer.acct.dropped[Outcome.STALE] == 1
    finally:
        buffer.close()
    resumed = RolloutBuffer(ctx, RolloutSection(max_new_tokens=64), "async", run_dir=tmp_path)
    resumed._handle(group_done(2, [31, 12], ["stop", "length"], episodes=True))  # generated again after the resume
    resumed.close()
    manager.close(linger=0)
    ctx.term()
    lines = [json.loads(line) for line in (tmp_path / LENGTHS_FILE).read_text().splitlines()]
    assert lines[0] == {
        "group": 0,
        "lengths": [64, 9],
        "truncated": [True, False],
        "max_new_tokens": 64,
        "episodes": False,
    }
    assert len(lines) == 4 and lines[2]["episodes"]
    assert sorted((g.group, g.lengths) for g in read_lengths(tmp_path)) == [(0, [64, 9]), (1, [3, 5, 7]), (2, [31, 12])]
