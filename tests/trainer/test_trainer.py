"""The GRPO trainer on gloo ranks, fed by rollouts of the embedded engine (in-process, fp32 or bf16).

Rollouts of an fp32 engine route exactly as the fp32 trainer does, so native agreement 1.0 proves the
rollout routing reaches each router in the order it sees its tokens (SP split, PP stage, micro-batch
padding); a bf16 engine routes some tokens differently, which replay off measures and R3 removes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.engines.protocol import decode_generate
from moerl.megatron.launch import run_ranks
from moerl.models import model_shape
from moerl.sample import Sample, SampleError
from moerl.trainer.config import OptimConfig, ReplayConfig, TrainerConfig
from moerl.trainer.objectives import LossConfig
from tests.workers import resume_and_step, step_at_version, train_steps
from tests.workers import save_and_resume as save_and_resume_worker

ARCH = "Qwen3MoeForCausalLM"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [20, 21, 22, 23, 24, 25], [40, 41]]


def rollout(hf_dir, dtype: torch.dtype) -> list[Sample]:
    engine = EmbeddedEngine(str(hf_dir), dtype=dtype, device="cpu")
    shape = model_shape(json.loads((hf_dir / "config.json").read_text()))
    engine.scheduler.start()
    try:
        return [
            sample
            for group, prompt in enumerate(PROMPTS)
            for sample in generate(engine, shape, prompt, 4, 6 + 3 * group, 100 * group, group)
        ]
    finally:
        engine.scheduler.stop()


def generate(engine, shape, prompt: list[int], n: int, max_new_tokens: int, seed: int, group: int) -> list[Sample]:
    body = {
        "input_ids": prompt,
        "return_logprob": True,
        "return_routed_experts": True,
        "return_sampling_mask": True,
        "sampling_params": {
            "n": n,
            "max_new_tokens": max_new_tokens,
            "top_k": 24,
            "temperature": 1.0,
            "sampling_seed": seed,
            "ignore_eos": True,
        },
    }
    samples = []
    for response in engine.generate(body):
        completion = decode_generate(response, shape)
        reward = float(np.mean(completion.output_ids % 2 == 0))  # a reward the policy can learn: even tokens
        samples.append(
            Sample.from_completion(
                completion, prompt, temperature=1.0, reward=reward, group_id=group, versions={"default": 0}
            )
        )
    return samples


def forked(hf_dir) -> list[Sample]:
    """One group's samples as an agent's episode forks them: the first, then samples whose prompt is its fed stream's
    first 9 tokens (a history re-rendered after its second action), then its first 7 (twice)."""
    engine = EmbeddedEngine(str(hf_dir), dtype=torch.float32, device="cpu")
    shape = model_shape(json.loads((hf_dir / "config.json").read_text()))
    engine.scheduler.start()
    try:
        (first,) = generate(engine, shape, [30, 31, 32, 33], 1, 8, 7, 9)
        stream = first.fed_ids().tolist()
        return [
            first,
            *generate(engine, shape, stream[:9], 1, 4, 8, 9),
            *generate(engine, shape, stream[:7], 2, 4, 9, 9),
        ]
    finally:
        engine.scheduler.stop()


@pytest.fixture(scope="module")
def fp32_samples(tiny_ckpts):
    return rollout(tiny_ckpts[ARCH][0], torch.float32)


@pytest.fixture(scope="module")
def bf16_samples(tiny_ckpts):
    return rollout(tiny_ckpts[ARCH][0], torch.bfloat16)


def config(routing: str, lr: float = 1e-3, **layout) -> TrainerConfig:
    return TrainerConfig(
        micro_batch_tokens=48,  # several micro-batches per rank; packed: several samples per row
        loss=LossConfig(entropy_coef=0.01),
        replay=ReplayConfig(routing=routing, sampling_mask=True),
        optim=OptimConfig(lr=lr, clip_grad=1e9),  # no clipping: gradients compared across layouts
        **layout,
    )


PACKED = {"micro_batch_format": "packed"}
SHARED = {**PACKED, "shared_prompt": True}
LAYOUTS = {
    "TP1": (1, {}),
    "DP2": (2, {}),
    "TP2+SP": (2, {"tp": 2}),
    "EP2": (2, {"ep": 2}),
    "PP2": (2, {"pp": 2}),
    "PP4": (4, {"pp": 4}),
    "packed TP2+SP+EP2": (2, {"tp": 2, "ep": 2, **PACKED}),
    "packed PP2": (2, {"pp": 2, **PACKED}),
    # each group's prompt fed once, the largest group (over micro_batch_tokens shared) fed unshared
    "shared TP2+SP+EP2": (2, {"tp": 2, "ep": 2, **SHARED}),
    "shared PP2": (2, {"pp": 2, **SHARED}),
    "shared DP2": (2, SHARED),
}


@pytest.fixture(scope="module")
def r3_samples(tiny_ckpts, fp32_samples):
    """The GRPO groups, and one group forked as an agent's episode forks (:func:`forked`)."""
    return fp32_samples + forked(tiny_ckpts[ARCH][0])


@pytest.fixture(scope="module")
def r3_runs(tiny_ckpts, r3_samples):
    mcore = str(tiny_ckpts[ARCH][1])
    return {
        name: run_ranks(train_steps, world, mcore, config("R3", **layout), r3_samples, 1)
        for name, (world, layout) in LAYOUTS.items()
    }


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_r3_routes_every_token_as_recorded(r3_runs, layout):
    metrics = r3_runs[layout][0]["metrics"][0]
    assert metrics["routing/replayed"] == 1.0
    # fp32 engine and fp32 trainer agree natively: the rollout rows reach the right router and token, and the gap is
    # measured there (each rollout expert is among the trainer's top k, on every rank)
    assert metrics["routing/agreement"] == 1.0 and metrics["routing/max_logit_gap"] == 0.0
    # so the engine's and the trainer's expert loads are the same counts, every layer gathered once over the ranks
    load_keys = [k for k in metrics if k.startswith("load/rollout_")]
    assert len(load_keys) == 2 + 2 * len([k for k in metrics if k.startswith("routing/agreement_layer")])
    assert all(metrics[k] == metrics[k.replace("rollout", "native")] for k in load_keys)
    # same weights, same routing, same kept sets: the trainer reproduces the engine's log-probs
    assert metrics["mismatch/abs_logprob_delta"] < 1e-5
    # no token's routing differs anywhere, so the mismatch has nothing to split off
    assert metrics["routing/differs_any_layer"] == 0.0
    assert np.isnan(metrics["mismatch/k3_kl_routing_differ"])
    assert metrics["mismatch/k3_kl_routing_agree"] == pytest.approx(metrics["mismatch/k3_kl"], rel=1e-9, abs=1e-15)


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "TP1"])
def test_loss_and_gradients_agree_across_layouts(r3_runs, layout):
    """Packed rows (samples end to end, each attending only to itself) score like padded ones: RoPE
    depends on relative positions only, so a sample's offset in the row changes nothing."""
    reference, other = r3_runs["TP1"][0], r3_runs[layout][0]
    assert other["metrics"][0]["train/loss"] == pytest.approx(reference["metrics"][0]["train/loss"], rel=1e-5)
    assert set(other["grads"]) == set(reference["grads"])
    for name, grad in reference["grads"].items():
        assert grad.abs().max() > 0 or name.endswith("bias"), name
        torch.testing.assert_close(other["grads"][name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


def common(before: Sample, sample: Sample) -> int:
    """The tokens of ``sample``'s prompt that ``before``'s fed stream starts with."""
    fed, prompt = before.fed_ids(), sample.prompt_ids
    n = min(len(fed), len(prompt))
    differ = np.flatnonzero(fed[:n] != prompt[:n])
    return int(differ[0]) if len(differ) else n


def fed_positions(members: list[Sample], budget: int) -> int:
    """The positions a group's samples take fed: each shares with the one before it what :func:`common` finds, and the
    group is cut where the next sample would take a part past ``budget`` (that sample is then fed whole)."""
    total, part = 0, 0
    for k, sample in enumerate(members):
        cost = sample.fed_len - (common(members[k - 1], sample) if k else 0)
        if k == 0 or part + cost > budget:
            total, part = total + part, sample.fed_len
        else:
            part += cost
    return total + part


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name.startswith("shared")])
def test_what_a_group_shares_is_fed_once_as_a_tree_within_the_budget(r3_runs, r3_samples, layout):
    """trainer.shared_prompt: each group's prompt is fed once where the group fits micro_batch_tokens (the largest
    GRPO group here does not: it is cut in two, the second part feeding the prompt again). The forked group's prompts
    are the first sample's stream cut at 9 tokens and at 7: fed once each, as a tree split at 9 and at 7. Every sample
    sharing a prefix agrees on its routing (the engine prefilled a group's prompt once; the fp32 engine routes a fork's
    prefix as it did the stream). The loss and gradients are the unshared step's (test_loss_and_gradients_agree_...)."""
    fork = [s for s in r3_samples if s.group_id == 9]
    stream = fork[0].fed_ids()
    assert fork[1].prompt_ids.tolist() == stream[:9].tolist() and fork[2].prompt_ids.tolist() == stream[:7].tolist()
    budget = config("R3").micro_batch_tokens
    groups = {s.group_id for s in r3_samples}
    expected = sum(fed_positions([s for s in r3_samples if s.group_id == group], budget) for group in groups)
    unshared = sum(s.fed_len for s in r3_samples)
    metrics = r3_runs[layout][0]["metrics"][0]
    assert metrics["train/tokens_fed"] == expected < unshared
    assert metrics["train/tokens"] == r3_runs["TP1"][0]["metrics"][0]["train/tokens"]
    assert r3_runs["TP1"][0]["metrics"][0]["train/tokens_fed"] == unshared
    assert metrics["routing/shared_prompt_disagreements"] == 0


@pytest.mark.e2e
def test_a_shared_prompt_crosses_the_data_plane_once_per_replica(tiny_ckpts, fp32_samples):
    """trainer.shared_prompt at PP2xDP2 (EP2): a group's samples go to one replica, and only its first sample's prompt
    (ids, routing) is sent: the others take it on arrival. Every rank's samples are those sent, whole, and the ranks
    take in fewer bytes than unshared."""
    from tests.workers import scatter_instalment

    mcore, layout = str(tiny_ckpts[ARCH][1]), {"pp": 2, "ep": 2}
    unshared = run_ranks(scatter_instalment, 4, mcore, config("R3", **layout, **PACKED), fp32_samples)
    shared = run_ranks(scatter_instalment, 4, mcore, config("R3", **layout, **SHARED), fp32_samples)
    for out in shared:
        needs = out["needs"]
        for got in out["samples"]:
            (sent,) = [
                s
                for s in fp32_samples
                if s.response_len == got.response_len
                and np.array_equal(s.routing[s.prompt_len :, list(needs.columns)], got.routing[got.prompt_len :])
            ]
            assert np.array_equal(got.routing, sent.routing[:, list(needs.columns)])
            if needs.ids:
                assert np.array_equal(got.prompt_ids, sent.prompt_ids)
                assert np.array_equal(got.response_ids, sent.response_ids)
        # responses run to their group's limit: their length names the group, and a replica holds whole groups
        groups = {got.response_len for got in out["samples"]}
        assert len(out["samples"]) == sum(s.response_len in groups for s in fp32_samples)
    assert sum(o["received"] for o in shared) < sum(o["received"] for o in unshared)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "layout,window",
    [({"pp": 2, "ep": 2}, None), ({"pp": 4}, 1), ({"tp": 2, "pp": 2}, None)],
    ids=["PP2xDP2", "PP4-window", "TP2xPP2"],
)
def test_each_rank_receives_only_its_own_shard_and_what_its_stage_reads(tiny_ckpts, fp32_samples, layout, window):
    """PP2xDP2 (EP2): two replicas of two stages; PP4: one layer per stage, the second dense. MoE layers 0, 2 and 3
    are routing columns 0, 1 and 2; the first stage reads token ids, the last ids and what the loss reads, a middle one
    only its routing; TP2xPP2: a TP peer gets its group's samples from the group's first rank. Each rank's bytes are its
    own shard's arrays plus the plan. Rank 0 stages the payloads it sends all at once within its window (these are
    small), and one at a time when the window holds none whole (PP4's)."""
    from moerl.trainer.batch import shard_by_tokens
    from tests.workers import scatter_instalment

    ranks = run_ranks(scatter_instalment, 4, str(tiny_ckpts[ARCH][1]), config("R3", **layout), fp32_samples, window)
    replicas = 4 // (layout["pp"] * layout.get("tp", 1))
    shards = shard_by_tokens([s.fed_len for s in fp32_samples], replicas)
    plan_bytes = 6 * 8 + len(fp32_samples) * 6 * 8  # header, and six numbers per sample
    assert {out["needs"].dp_rank for out in ranks} == set(range(replicas))
    columns = {2: [(0,), (1, 2)], 4: [(0,), (), (1,), (2,)]}[layout["pp"]]
    for rank, out in enumerate(ranks):
        needs, mine = out["needs"], [fp32_samples[i] for i in shards[out["needs"].dp_rank]]
        stage = rank // (4 // layout["pp"])
        assert needs.columns == columns[stage] and needs.last == (stage == layout["pp"] - 1)
        assert needs.ids == (stage in (0, layout["pp"] - 1))
        assert len(out["samples"]) == len(mine)
        shard_bytes = 0
        for got, sent in zip(out["samples"], mine, strict=True):
            assert np.array_equal(got.routing, sent.routing[:, list(needs.columns)])
            assert (
                got.prompt_len == sent.prompt_len
                and got.response_len == sent.response_len
                and got.temperature == sent.temperature
            )
            shard_bytes += got.routing.nbytes
            if needs.ids:
                assert np.array_equal(got.prompt_ids, sent.prompt_ids) and np.array_equal(
                    got.response_ids, sent.response_ids
                )
                shard_bytes += 4 * (sent.prompt_len + sent.response_len)
            else:
                assert not got.prompt_ids.any() and not got.response_ids.any()
            if needs.last:
                for name in ("selected_logprobs", "versions", "mask_offsets", "mask_ids"):
                    assert np.array_equal(getattr(got, name), getattr(sent, name)), name
                shard_bytes += sent.response_len * (4 + 8 + 4) + 4 * len(sent.mask_ids)
            else:
                assert got.mask_ids is None and not got.versions.any()  # what the loss reads stays on the last stage
        if rank == 0:
            assert out["received"] == 0
        else:  # fields are 8-byte aligned
            assert shard_bytes <= out["received"] - plan_bytes < shard_bytes + 8 * 5, rank
    # TP firsts
    sent = [out["received"] - plan_bytes for rank, out in enumerate(ranks) if rank and rank % layout.get("tp", 1) == 0]
    assert ranks[0]["staged_peak"] == (max(sent) if window else sum(sent)) and (len(sent) == 1 or max(sent) < sum(sent))


@pytest.mark.e2e
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_replay_targets_leave_the_device_once_no_backward_replays_them(tiny_ckpts, fp32_samples, recompute):
    """Megatron queues every micro-batch's replay targets for a backward replay that only activation recompute makes
    (and takes off the queue): without recompute, or in a forward-only pass, each must go once its forward is done, or a
    pass holds all its micro-batches' targets on the device at once."""
    from tests.workers import replay_queue_depths

    (seen,) = run_ranks(
        replay_queue_depths, 1, str(tiny_ckpts[ARCH][1]), config("R3", recompute=recompute), fp32_samples
    )
    assert seen["given"] > 2 * 3 * 2  # several micro-batches a pass, two passes, the tiny model's three MoE layers
    assert seen["deepest"] == 1  # without pipelining, a micro-batch's backward comes before the next one's forward


@pytest.mark.e2e
def test_bf16_engine_disagrees_natively_and_r3_restores_its_routing(tiny_ckpts, bf16_samples):
    mcore = str(tiny_ckpts[ARCH][1])
    (off,) = run_ranks(train_steps, 1, mcore, config("off"), bf16_samples, 1)
    (r3,) = run_ranks(train_steps, 1, mcore, config("R3"), bf16_samples, 1)
    assert off["metrics"][0]["routing/agreement"] < 1.0 and off["metrics"][0]["routing/max_logit_gap"] > 0
    assert off["metrics"][0]["routing/replayed"] == off["metrics"][0]["routing/agreement"]
    assert r3["metrics"][0]["routing/replayed"] == 1.0
    # replaying the engine's routing brings the trainer's log-probs closer to the engine's
    assert r3["metrics"][0]["mismatch/abs_logprob_delta"] < off["metrics"][0]["mismatch/abs_logprob_delta"]
    # The mismatch lives on the tokens whose experts flipped (here 300x the others' k3); R3 still probes the native
    # routing, so it reports the same kind of flips, and on those tokens the mismatch falls to the others' level.
    off, r3 = off["metrics"][0], r3["metrics"][0]
    assert off["routing/differs_any_layer"] > 0 and r3["routing/differs_any_layer"] > 0
    assert off["mismatch/k3_kl_routing_differ"] > 30 * off["mismatch/k3_kl_routing_agree"]
    assert r3["mismatch/k3_kl_routing_differ"] < 3 * r3["mismatch/k3_kl_routing_agree"]


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["TP1", "packed TP2+SP+EP2", "PP2"])
def test_the_mismatch_splits_by_routing_and_lag_where_flips_and_drift_are_planted(tiny_ckpts, fp32_samples, layout):
    """The fp32 engine's rollouts, altered: every third response token's position routed to other experts in one MoE
    layer
    (the first layer's or the last's, which PP2 holds on different stages) and its behaviour log-prob lowered by 0.5;
    groups 0 and 1 sampled a version before the trainer's. Replay off leaves the trainer's log-probs as they were, so
    exactly the planted tokens differ and carry the whole mismatch, at its known size, in both lag parts."""
    import dataclasses

    planted, differ = [], np.zeros(2)  # planted tokens at lag 0 and lag 1
    tokens = np.zeros(2)
    for s in fp32_samples:
        routing, behaviour, selected = s.routing.copy(), s.behaviour_logprobs.copy(), s.selected_logprobs.copy()
        experts = int(routing.max()) + 1
        flipped = np.arange(1, s.response_len, 3)
        for j in flipped:
            column = 0 if j % 2 else -1
            routing[s.prompt_len - 1 + j, column] = (
                routing[s.prompt_len - 1 + j, column].astype(np.int64) + 1
            ) % experts
        behaviour[flipped] -= 0.5
        selected[flipped] -= 0.5
        lag = int(s.group_id < 2)
        differ[lag] += len(flipped)
        tokens[lag] += s.response_len
        planted.append(
            dataclasses.replace(
                s,
                routing=routing,
                behaviour_logprobs=behaviour,
                selected_logprobs=selected,
                versions=np.full(s.response_len, 1 - lag, dtype=np.int64),
            )
        )
    world, parallel = LAYOUTS[layout]
    metrics = run_ranks(step_at_version, world, str(tiny_ckpts[ARCH][1]), config("off", **parallel), planted, 1)[0]
    k3 = np.exp(-0.5) + 0.5 - 1
    assert metrics["routing/differs_any_layer"] == pytest.approx(differ.sum() / tokens.sum(), abs=1e-12)
    assert metrics["mismatch/abs_logprob_delta"] == pytest.approx(0.5 * differ.sum() / tokens.sum(), abs=1e-5)
    for part in ("routing", "lag0_routing"):
        assert metrics[f"mismatch/abs_logprob_delta_{part}_differ"] == pytest.approx(0.5, abs=1e-5)
        assert metrics[f"mismatch/k3_kl_{part}_differ"] == pytest.approx(k3, abs=1e-5)
        assert (
            metrics[f"mismatch/abs_logprob_delta_{part}_agree"] < 1e-5
            and metrics[f"mismatch/k3_kl_{part}_agree"] < 1e-9
        )
    for lag, part in enumerate(("lag0", "lagged")):
        assert metrics[f"mismatch/abs_logprob_delta_{part}"] == pytest.approx(0.5 * differ[lag] / tokens[lag], abs=1e-5)
    assert metrics["staleness/lag_1"] == pytest.approx(tokens[1] / tokens.sum())


TRACED = {
    "TP2+SP": LAYOUTS["TP2+SP"],
    "EP2": LAYOUTS["EP2"],
    "PP2": LAYOUTS["PP2"],
    "packed TP2+SP+EP2": LAYOUTS["packed TP2+SP+EP2"],
    "recompute PP2": (2, {"pp": 2, "recompute": True}),
}


def traced(tmp_path, routing: str = "R3", samples: int = 8, **layout) -> TrainerConfig:
    cfg = config(routing, **layout)
    cfg.replay.trace_samples, cfg.replay.trace_dir = samples, str(tmp_path / "replay_trace")
    return cfg


@pytest.mark.e2e
@pytest.mark.parametrize("layout", list(TRACED))
def test_check_replay_passes_on_real_runs(tiny_ckpts, bf16_samples, tmp_path, layout):
    """A bf16 engine's rollouts: the trainer's own routers would route some positions elsewhere, so the check can tell
    replay from none."""
    from moerl.trainer.replay_trace import check_replay

    world, parallel = TRACED[layout]
    run_ranks(train_steps, world, str(tiny_ckpts[ARCH][1]), traced(tmp_path, **parallel), bf16_samples, 1)
    report = check_replay(tmp_path)
    assert report.ok, report.summary()
    replicas = world // (parallel.get("tp", 1) * parallel.get("pp", 1))
    assert report.steps == 1 and report.samples == 8 * replicas and report.mode == "R3"
    assert report.passes == ({"score", "train", "recompute"} if parallel.get("recompute") else {"score", "train"})
    assert report.checked > report.informative > 0 and report.native_agree < 1.0


@pytest.mark.e2e
@pytest.mark.parametrize(
    "worker", ["train_with_routing_one_position_late", "train_with_routing_columns_swapped", "train_without_replay"]
)
def test_check_replay_finds_a_planted_fault_and_says_where(tiny_ckpts, bf16_samples, tmp_path, capsys, worker):
    """Routing placed one position late in the micro-batches (TP2+SP); the routing a rank is sent put in the wrong
    column (EP2); the training pass run without replay (PP2 with recompute)."""
    from moerl.cli import main
    from tests import workers

    layout = {
        "train_with_routing_one_position_late": {"tp": 2},
        "train_with_routing_columns_swapped": {"ep": 2},
        "train_without_replay": {"pp": 2, "recompute": True},
    }[worker]
    run_ranks(getattr(workers, worker), 2, str(tiny_ckpts[ARCH][1]), traced(tmp_path, **layout), bf16_samples, 1)
    assert main(["check-replay", str(tmp_path), "--show", "100000"]) == 1
    out = capsys.readouterr().out
    assert "REPLAY MISMATCH" in out
    if worker == "train_with_routing_one_position_late":
        assert "score used experts" in out and "train used experts" in out
        assert "position 0 layer" in out  # the first position took the padding's set, not its own
    elif worker == "train_with_routing_columns_swapped":
        assert "the rank received routing" in out
    else:
        assert "train used experts" in out and "recompute used experts" in out and "score used experts" not in out


@pytest.mark.e2e
def test_check_replay_under_r2_checks_the_training_pass_against_the_old_policy_pass(tiny_ckpts, bf16_samples, tmp_path):
    from moerl.trainer.replay_trace import check_replay

    run_ranks(train_steps, 2, str(tiny_ckpts[ARCH][1]), traced(tmp_path, "R2", pp=2, recompute=True), bf16_samples, 1)
    report = check_replay(tmp_path)
    assert report.ok, report.summary()
    assert report.mode == "R2" and report.passes == {"score", "train", "recompute"}
    assert (
        report.native_agree < 1.0
    )  # a bf16 engine: the trainer's routers disagree with it, and R2 does not replay the rollout
    # One optimizer step per batch: the training pass runs at the old-policy pass's weights, so it would route the same
    # without replay, and the report says the trace cannot tell.
    assert report.informative == 0 and "UNINFORMATIVE" in report.summary()


@pytest.mark.e2e
def test_the_expert_load_of_a_planted_routing_is_what_it_must_be(tiny_ckpts, fp32_samples):
    """Every rollout token sent to experts 0..k-1 in every layer: that load is experts/k times the mean on its busiest
    expert, its entropy log k / log experts; the trainer's own routers (replay off) spread the same tokens wider."""
    import dataclasses

    from moerl.models import family_for

    raw = json.loads((tiny_ckpts[ARCH][0] / "config.json").read_text())
    hf_config = family_for(raw).normalize(raw)
    experts, k = hf_config["num_experts"], hf_config["num_experts_per_tok"]
    planted = [
        dataclasses.replace(s, routing=np.broadcast_to(np.arange(k, dtype=s.routing.dtype), s.routing.shape).copy())
        for s in fp32_samples
    ]
    (off,) = run_ranks(train_steps, 1, str(tiny_ckpts[ARCH][1]), config("off"), planted, 1)
    metrics = off["metrics"][0]
    assert metrics["load/rollout_max_over_mean"] == pytest.approx(experts / k)
    assert metrics["load/rollout_entropy"] == pytest.approx(np.log(k) / np.log(experts))
    assert metrics["load/native_max_over_mean"] < experts / k and metrics["load/native_entropy"] > np.log(k) / np.log(
        experts
    )


@pytest.mark.e2e
def test_after_a_load_each_parameter_counts_its_own_adam_steps(tiny_ckpts, fp32_samples):
    """megatron-core's DistributedOptimizer without Apex or TE loads one step tensor into every parameter's state and
    torch's Adam adds 1 to it in place per parameter; the trainer gives each its own, so the count stays the step's."""
    from tests.workers import adam_steps_after_a_shared_step_is_loaded

    (steps,) = run_ranks(
        adam_steps_after_a_shared_step_is_loaded, 1, str(tiny_ckpts[ARCH][1]), config("R3"), fp32_samples
    )
    assert len(steps) > 1 and set(steps) == {2.0}


@pytest.fixture(scope="module")
def free_run(tiny_ckpts, fp32_samples):
    """Three steps on one batch without a KL term."""
    return run_ranks(train_steps, 1, str(tiny_ckpts[ARCH][1]), config("R3", lr=3e-3), fp32_samples, 3)[0]


@pytest.mark.e2e
def test_optimizer_steps_raise_the_reward_weighted_log_likelihood(free_run):
    run = free_run
    objective = run["objective"]
    assert objective[-1] > objective[0] + 0.1, objective
    assert all(m["train/update_skipped"] == 0.0 for m in run["metrics"])
    assert [m["staleness/max"] for m in run["metrics"]] == [0.0, 1.0, 2.0]  # the batch ages one version per step


def test_samples_refuse_inconsistent_arrays(fp32_samples):
    s = fp32_samples[0]
    with pytest.raises(SampleError, match="routing has shape"):
        Sample(**{**s.__dict__, "routing": s.routing[:-1]}).validate()
    bad_ids = s.mask_ids.copy()
    bad_ids[s.mask_offsets[0] : s.mask_offsets[1]] = (s.response_ids[0] + 1) % 256
    with pytest.raises(SampleError, match="response token 0 is not in its own kept set"):
        Sample(**{**s.__dict__, "mask_ids": bad_ids}).validate()
    last = s.response_len - 1
    bad_ids = s.mask_ids.copy()
    bad_ids[s.mask_offsets[last] :] = (s.response_ids[last] + 1) % 256
    with pytest.raises(SampleError, match=f"response token {last} is not in its own kept set"):
        Sample(**{**s.__dict__, "mask_ids": bad_ids}).validate()


@pytest.fixture(scope="module")
def ep2_resume(tiny_ckpts, fp32_samples, tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("resume") / "ckpt"
    return ckpt, run_ranks(
        save_and_resume_worker, 2, str(tiny_ckpts[ARCH][1]), config("R3", ep=2), fp32_samples, str(ckpt)
    )[0]


@pytest.mark.e2e
def test_saved_trainer_resumes_exactly(ep2_resume):
    ckpt, out = ep2_resume
    assert out["version"] == 2
    for key in ("train/loss", "train/grad_norm", "routing/agreement", "mismatch/k3_kl"):
        assert out["got"][key] == out["expected"][key], key
    assert out["got"]["train/loss"] != out["first"]["train/loss"]
    for name, tensor in out["expected_weights"].items():
        assert torch.equal(out["weights"][name], tensor), name
    assert (ckpt / "hf" / "config.json").is_file()  # also a model checkpoint


@pytest.mark.e2e
def test_reference_kl_starts_at_zero_and_holds_the_policy_back(tiny_ckpts, fp32_samples, free_run):
    held_cfg = config("R3", lr=3e-3)
    held_cfg.loss.kl_coef = 5.0
    free = free_run
    (held,) = run_ranks(train_steps, 1, str(tiny_ckpts[ARCH][1]), held_cfg, fp32_samples, 3)
    kl = [m["train/ref_kl"] for m in held["metrics"]]
    assert abs(kl[0]) < 1e-9 and kl[1] > 0 and kl[2] > 0, kl
    gain = lambda run: run["objective"][-1] - run["objective"][0]  # noqa: E731
    assert 0 < gain(held) < gain(free)


@pytest.mark.e2e
def test_activation_recompute_replays_each_micro_batchs_routing(tiny_ckpts, r3_samples, r3_runs):
    # Under 1F1B a micro-batch is recomputed after later ones have set their targets (PP2 shows it;
    # without pipelining each backward follows its own forward at once).
    world, parallel = LAYOUTS["PP2"]
    cfg = config("R3", **parallel)
    cfg.recompute = True
    out = run_ranks(train_steps, world, str(tiny_ckpts[ARCH][1]), cfg, r3_samples, 1)[0]
    reference = r3_runs["TP1"][0]
    assert out["metrics"][0]["train/loss"] == pytest.approx(reference["metrics"][0]["train/loss"], rel=1e-5)
    for name, grad in reference["grads"].items():
        torch.testing.assert_close(out["grads"][name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(), msg=name)


@pytest.mark.e2e
@pytest.mark.parametrize("layout", ["TP2+EP2", "EP1"])
def test_a_trainer_saved_at_ep2_resumes_at_another_layout(tiny_ckpts, fp32_samples, ep2_resume, layout):
    """Model and optimizer state (Adam moments of every expert) reshard; at EP1 each rank holds all experts."""
    ckpt, expected = ep2_resume
    parallel = {"TP2+EP2": {"tp": 2, "ep": 2}, "EP1": {"ep": 1}}[layout]
    out = run_ranks(resume_and_step, 2, str(tiny_ckpts[ARCH][1]), config("R3", **parallel), fp32_samples, str(ckpt))[0]
    assert out["got"]["train/loss"] == pytest.approx(expected["expected"]["train/loss"], rel=1e-5)
    assert out["got"]["train/grad_norm"] == pytest.approx(expected["expected"]["train/grad_norm"], rel=1e-5)
    for name, tensor in expected["expected_weights"].items():
        torch.testing.assert_close(out["weights"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.e2e
@pytest.mark.parametrize("aggregation, budget", [("token_mean", 48), ("seq_mean_token_sum_norm", 1)])
def test_a_batch_fed_in_instalments_steps_like_the_whole_batch(tiny_ckpts, fp32_samples, aggregation, budget):
    """budget=1: one sample per micro-batch, so the two EP ranks' shards (balanced by tokens, not by
    count) need different numbers of micro-batches; the trainer evens them out or the all-to-all hangs."""
    from moerl.trainer.objectives import LossConfig
    from tests.workers import step_whole_and_in_instalments

    _, mcore = tiny_ckpts["Qwen3MoeForCausalLM"]
    cfg = config("R3", lr=1e-2, ep=2)
    cfg.loss = LossConfig(aggregation=aggregation)
    cfg.micro_batch_tokens = budget
    out = run_ranks(step_whole_and_in_instalments, 2, str(mcore), cfg, fp32_samples)[0]
    for key in ("train/loss", "train/grad_norm", "routing/agreement", "mismatch/k3_kl", "train/tokens"):
        assert out["got"][key] == pytest.approx(out["expected"][key], rel=1e-5, abs=1e-7), key
    for name, grad in out["expected_grads"].items():
        torch.testing.assert_close(
            out["grads"][name],
            grad,
            rtol=1e-5,
            atol=1e-6 * grad.abs().max().item(),
            msg=lambda m, name=name: f"{name}: {m}",
        )


@pytest.mark.e2e
def test_a_trainer_offloaded_between_steps_trains_bitwise_as_one_never_offloaded(tiny_ckpts, fp32_samples):
    """Colocated placement takes the trainer's weights, optimizer state and gradients off its device after each push
    and the next step reloads them: at EP2 over two ranks, every step's metrics and the final weights are those of a
    trainer that kept them, and nothing of them is left on the device while offloaded."""
    from tests.workers import steps_offloaded_between

    mcore = str(tiny_ckpts[ARCH][1])
    kept, offloaded = (
        run_ranks(steps_offloaded_between, 2, mcore, config("R3", ep=2), fp32_samples, 3, offload)
        for offload in (False, True)
    )
    for a, b in zip(kept, offloaded, strict=True):
        for step, (m, n) in enumerate(zip(a["metrics"], b["metrics"], strict=True)):
            differ = {k: (m[k], n[k]) for k in m if m[k] != n[k] and not (np.isnan(m[k]) and np.isnan(n[k]))}
            assert m.keys() == n.keys() and not differ, (step, differ)
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert all(moved > 0 for moved in b["offloaded"]) and b["left"] == [0, 0, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_a_trainer_whose_communicators_are_suspended_between_steps_trains_as_one_that_kept_them(
    tiny_ckpts, fp32_samples
):
    """On a GPU the offload also suspends megatron-core's NCCL communicators that a collective has used, and the next
    step resumes them: three steps give the metrics of a trainer that never offloaded. Skipped, saying why, where torch
    or NCCL cannot suspend (torch < 2.12, NCCL < 2.29.7)."""
    from tests.workers import steps_offloaded_between

    mcore = str(tiny_ckpts[ARCH][1])
    (kept,), (offloaded,) = (
        run_ranks(steps_offloaded_between, 1, mcore, config("R3"), fp32_samples, 3, offload)
        for offload in (False, True)
    )
    if offloaded["unsupported"] is not None:
        pytest.skip(f"this torch cannot suspend NCCL communicators: {offloaded['unsupported']}")
    assert all(count > 0 for count in offloaded["suspended"])  # the gradient norm's all-reduce, at least
    for m, n in zip(kept["metrics"], offloaded["metrics"], strict=True):
        for key, value in m.items():
            assert n[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key


@pytest.mark.e2e
def test_every_offload_on_a_gpu_gives_the_freed_memory_back_to_the_device(tiny_ckpts, fp32_samples):
    """Offloaded storages go back to torch's caching allocator, which keeps them from colocated engines that wake next
    and size their KV cache from the device's free memory: on a GPU every way the trainer's state leaves the device
    ends with one ``torch.cuda.empty_cache``, once the storages are off (the offloads hold bytes then)."""
    from tests.trainer.offload_workers import offloads_on_a_gpu

    (emptied,) = run_ranks(offloads_on_a_gpu, 1, str(tiny_ckpts[ARCH][1]), config("R3"), fp32_samples)
    assert len(emptied) == 4
    for way, held in emptied.items():
        assert len(held) == 1 and held[0] > 0, (way, held)
    assert emptied["the rest after a push"][0] > emptied["training state after a step"][0]  # the weights too


@pytest.mark.e2e
def test_a_push_brings_back_the_weights_alone_and_training_goes_on_as_if_never_offloaded(tiny_ckpts, fp32_samples):
    """A push that finds the trainer's state offloaded (the first push of a resumed run, a catch-up, while the engines
    are awake beside it) brings back the weights alone, with their bytes; the optimizer state and the gradient buffers
    stay off, and everything is off again after it. The next step's metrics are those of a trainer never offloaded."""
    from tests.trainer.offload_workers import steps_with_a_push_between

    mcore = str(tiny_ckpts[ARCH][1])
    (kept,), (pushed,) = (
        run_ranks(steps_with_a_push_between, 1, mcore, config("R3"), fp32_samples, offload) for offload in (False, True)
    )
    before, within = pushed["before"], pushed["within"]
    assert min(before.values()) > 0
    assert within == {"weights": before["weights"], "state": 0, "grads": 0}
    assert pushed["after"] == {"weights": 0, "state": 0, "grads": 0}
    weights = pushed["weights before"]
    assert all(torch.equal(weights[k], pushed["weights within"][k]) for k in weights)
    for m, n in zip(kept["metrics"], pushed["metrics"], strict=True):
        differ = {k: (m[k], n[k]) for k in m if m[k] != n[k] and not (np.isnan(m[k]) and np.isnan(n[k]))}
        assert m.keys() == n.keys() and not differ, differ


@pytest.mark.e2e
def test_communicators_stay_on_every_rank_where_one_ranks_torch_lacks_communicator_offload():
    """torch 2.12+ compiled against an NCCL older than 2.29.7 has ``Backend.suspend`` and raises when it runs, however
    new the NCCL it loads. The ranks find it before any suspend and agree: where any rank lacks it none suspends (one
    that did would wait in NCCL for the others for good), each says why once, and the offloads go on without; where
    none lacks it, each suspends and resumes."""
    from tests.trainer.offload_workers import communicators_where_ranks_lack_offload

    every, one, none = zip(*run_ranks(communicators_where_ranks_lack_offload, 2, [[0, 1], [1], []]), strict=True)
    for case, first in ((every, 0), (one, 1)):
        for rank in case:
            assert rank["freed"] == [0, 0, 0] and rank["calls"] == []
            assert rank["unsupported"].startswith(f"rank {first}: torch ")
            assert "getMemoryStats() requires NCCL 2.29.7 or later" in rank["unsupported"]
            assert rank["said"] == [
                f"megatron-core's NCCL communicators stay on the GPU meanwhile: {rank['unsupported']}"
            ]
    for rank in none:
        assert rank["freed"] == [1 << 20, 0, 1 << 20] and rank["calls"] == ["suspend", "resume"] * 2
        assert rank["unsupported"] is None and rank["said"] == []


def test_bf16_moments_are_refused_where_the_precision_aware_optimizer_cannot_run():
    """megatron-core keeps Adam's moments in bf16 only in its precision-aware optimizer (Transformer Engine's FusedAdam
    with the distributed optimizer): without CUDA the trainer says so before it loads anything."""
    from moerl.errors import ConfigError
    from moerl.trainer.trainer import Trainer

    with pytest.raises(ConfigError, match=r"trainer\.optim\.moments_dtype=bfloat16 needs .* FusedAdam on CUDA"):
        Trainer("/nonexistent", TrainerConfig(optim=OptimConfig(moments_dtype="bfloat16")))
