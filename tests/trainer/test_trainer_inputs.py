"""What the trainer hands the model per micro-batch: the routing of padding positions, the copies of its inputs to the
device, and when the routing probe runs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moerl.megatron.launch import run_ranks
from moerl.sample import Sample
from moerl.trainer.batch import build_micro_batch

ARCH = "Qwen3MoeForCausalLM"


def _sample(rng: np.random.Generator, fed: int, layers: int, topk: int, experts: int, group: int = 0) -> Sample:
    """A sample of ``fed`` fed tokens (a one-token prompt), each routed to ``topk`` distinct experts in every layer."""
    routing = np.argsort(rng.random((fed, layers, experts)), axis=-1)[..., :topk].astype(np.uint8)
    ids = rng.integers(1, 200, fed + 1, dtype=np.int32)
    return Sample(
        prompt_ids=ids[:1],
        response_ids=ids[1:],
        behaviour_logprobs=np.full(fed, -2.0, np.float32),
        versions=np.zeros(fed, np.int64),
        routing=routing,
        reward=float(rng.random()),
        group_id=group,
    ).validate()


def _padding_loads(batch, experts: int, ep: int) -> tuple[np.ndarray, np.ndarray]:
    """Over the padding positions of every layer: tokens per expert [layers, experts] and per expert-parallel rank
    [layers, ep] (rank r holds the contiguous experts r * experts / ep onwards, as megatron-core places them)."""
    padded = batch.routing[~batch.real_positions()]  # [positions, layers, topk]
    per_expert = np.stack([np.bincount(padded[:, i].ravel(), minlength=experts) for i in range(padded.shape[1])])
    return per_expert, per_expert.reshape(len(per_expert), ep, experts // ep).sum(-1)


@pytest.mark.parametrize("experts,topk,ep", [(128, 8, 8), (128, 8, 2), (60, 4, 4), (60, 4, 2), (8, 2, 2)])
@pytest.mark.parametrize("packed", [False, True])
def test_padding_is_spread_evenly_over_the_experts_of_every_expert_parallel_rank(experts, topk, ep, packed):
    """Padding still goes through the routers and, under R3, to the experts replay names. A micro-batch mostly padding
    (one long row, short ones; packed: a long tail) gives every EP rank the same padding load, every expert the same
    where the padding spans whole turns of the rotation, each position distinct experts in range, and leaves the
    samples' own routing as it came. Experts 0..topk-1 for all padding put it on rank 0 alone: max/mean = ep."""
    rng = np.random.default_rng(0)
    samples = [_sample(rng, fed, 3, topk, experts, group) for group, fed in enumerate([60, 12, 12, 12, 12, 12])]
    batch = build_micro_batch(
        samples,
        [0.0] * 6,
        [1.0] * 6,
        multiple=360 if packed else 60,
        use_masks=False,
        routed_experts=experts,
        packed=packed,
    )
    real = batch.real_positions()
    padding_positions = int((~real).sum())
    assert padding_positions == 240 == 2 * real.sum()  # whole turns of the rotation at every shape: 16, 15, 4 positions
    per_expert, per_rank = _padding_loads(batch, experts, ep)
    assert (per_rank == padding_positions * topk // ep).all()  # max / mean = 1 on every layer
    assert (per_expert == padding_positions * topk // experts).all()
    padded = batch.routing[~real]
    assert (np.sort(padded, -1)[..., 1:] != np.sort(padded, -1)[..., :-1]).all() and padded.max() < experts
    assert np.array_equal(batch.routing[real], np.concatenate([s.routing for s in samples]))


def test_every_position_sends_each_rank_its_share_where_the_ep_size_divides_topk():
    """A dispatch sees a sequence chunk of a micro-batch (sequence parallelism), so the spread holds position by
    position, not only over the whole micro-batch."""
    from moerl.trainer.batch import padding_routing

    sets = padding_routing(1000, 8, 128, np.dtype(np.uint8))
    assert (np.stack([np.bincount(s // 16, minlength=8) for s in sets]) == 1).all()  # EP8: one expert on each rank
    assert len(np.unique(np.sort(sets, -1), axis=0)) == 16  # 16 sets in turn, together every expert


class _Copied:
    """A stand-in tensor that records how it is copied."""

    def __init__(self, device: str):
        self.device, self.calls = torch.device(device), []

    def pin_memory(self):
        self.calls.append("pin")
        return self

    def to(self, device, non_blocking=False):
        self.calls.append((torch.device(device).type, non_blocking))
        return self


def test_host_tensors_reach_a_gpu_from_page_locked_memory_without_blocking():
    """Host to GPU: staged in page-locked memory, copied without blocking. Anything else (to the host, which must not
    be read before a sync if made without blocking; on the device already; the CPU path) is a plain copy."""
    from moerl.megatron.forward import host_to_device

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert host_to_device(_Copied("cpu"), cuda).calls == ["pin", ("cuda", True)]
    assert host_to_device(_Copied("cuda"), cpu).calls == [("cpu", False)]
    assert host_to_device(_Copied("cuda"), cuda).calls == [("cuda", False)]
    assert host_to_device(_Copied("cpu"), cpu).calls == [("cpu", False)]
    host = torch.arange(3)
    assert host_to_device(host, cpu) is host


def test_the_model_inputs_and_replay_targets_go_through_the_non_blocking_copy(monkeypatch):
    """Token positions, THD boundaries, the loss's inputs and the R3 targets of all routers: each reaches the GPU by
    :func:`host_to_device`, the targets in one copy of the rollout's dtype, widened to int64 there, in each router's
    token order (here the second of two sequence-parallel ranks)."""
    from moerl.trainer import batch as batch_module
    from moerl.trainer import routing as routing_module

    copied = []

    def recording(tensor, device):
        copied.append((tuple(tensor.shape), tensor.dtype, device.type))
        return tensor

    monkeypatch.setattr(batch_module, "host_to_device", recording)
    monkeypatch.setattr(routing_module, "host_to_device", recording)
    rng = np.random.default_rng(1)
    samples = [_sample(rng, fed, 3, 2, 8) for fed in (5, 3)]
    cuda = torch.device("cuda")
    packed = build_micro_batch(
        samples, [1.0, 1.0], [1.0, 1.0], multiple=5, use_masks=False, routed_experts=8, packed=True
    )
    packed.packed_inputs(cuda, thd=True)
    assert copied == [((10,), torch.int64, "cuda"), ((4,), torch.int32, "cuda")]  # positions; bounds, the tail's too
    copied.clear()
    padded = build_micro_batch(samples, [1.0, 1.0], [1.0, 1.0], multiple=2, use_masks=False, routed_experts=8)
    padded.loss_inputs_to(cuda)
    assert len(copied) == 9 and {device for *_, device in copied} == {"cuda"}  # every loss input; no kept sets here
    copied.clear()
    routers = routing_module.LocalRouters.__new__(routing_module.LocalRouters)
    routers.routers, routers.sp_size, routers.sp_rank = [None] * 3, 2, 1
    targets = routers.replay_targets(padded.routing, cuda)
    assert copied == [((3 * 2, 3, 2), torch.uint8, "cuda")]  # [s_local * b, routers, topk], as the rollout sent it
    expected = np.swapaxes(padded.routing, 0, 1)[3:].reshape(6, 3, 2)
    assert all(t.dtype == torch.int64 and np.array_equal(t.numpy(), expected[:, i]) for i, t in enumerate(targets))


# ---- the routing probe -----------------------------------------------------------------------------
def probed_steps(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """A step of a fresh trainer on ``samples`` as they are and without their routing: its metrics and how many
    routing probes it ran; and the experts the padding positions of the first one's micro-batches are given."""
    from moerl.trainer import routing
    from moerl.trainer.trainer import Trainer

    probes = []
    enter = routing.RoutingProbe.__enter__

    def counted(probe):
        probes.append(probe)
        return enter(probe)

    routing.RoutingProbe.__enter__ = counted
    out = {}
    for name, batch in (("routing", samples), ("none", [dataclasses.replace(s, routing=None) for s in samples])):
        trainer = Trainer(mcore_dir, trainer_cfg)
        if name == "routing":
            micro_batches = trainer.micro_batches(trainer.batches.scatter(batch))
            out["padding"] = np.concatenate([mb.routing[~mb.real_positions()] for mb in micro_batches])
            out["experts"] = trainer.routers.num_experts
        probes.clear()
        out[name] = {"metrics": trainer.step(batch), "probes": len(probes)}
    return out


@pytest.mark.e2e
def test_the_probe_runs_only_in_the_old_pass_of_a_batch_with_routing(tiny_ckpts):
    """The probe (a gating GEMM and a copy to the host per router and micro-batch) feeds the routing/ and load/
    metrics and the mismatch split by routing. A step whose samples carry no routing runs none; one whose samples do
    runs it once, in the old-policy pass: not in the reference pass, nor in training without a trace. Routing that is
    only measured (replay off) changes no other metric. The trainer gives padding every expert of the model."""
    from moerl.trainer.config import OptimConfig, ReplayConfig, TrainerConfig
    from moerl.trainer.objectives import LossConfig

    rng = np.random.default_rng(2)
    samples = [_sample(rng, fed, 3, 2, 8, group=i // 2) for i, fed in enumerate([9, 4, 12, 6, 3, 7, 5, 10])]
    cfg = TrainerConfig(
        micro_batch_tokens=32,
        loss=LossConfig(kl_coef=0.1),
        replay=ReplayConfig(routing="off", sampling_mask=False),
        optim=OptimConfig(lr=1e-3),
    )
    (out,) = run_ranks(probed_steps, 1, str(tiny_ckpts[ARCH][1]), cfg, samples)
    with_routing, without = out["routing"], out["none"]
    assert without["probes"] == 0 and with_routing["probes"] == 1
    routing_keys = {k for k in with_routing["metrics"] if k.startswith(("routing/", "load/")) or "_routing_" in k}
    assert "routing/agreement" in routing_keys and "load/native_max_over_mean" in routing_keys
    assert set(with_routing["metrics"]) - routing_keys == set(without["metrics"])
    for key, value in without["metrics"].items():  # the split's cells are summed in other groups: equal to rounding
        assert with_routing["metrics"][key] == pytest.approx(value, rel=1e-12, abs=1e-15, nan_ok=True), key
    assert set(np.unique(out["padding"])) == set(range(out["experts"]))


def test_a_shared_prompt_is_fed_once_each_response_seeing_it_and_itself_at_its_own_positions():
    """Three samples of one prompt (sharing its 3 tokens with the one before) and one of their own, packed: the prompt
    once, then
    each response; a response attends to the prompt and to its own earlier tokens only, rotated as in its own
    sequence; each first action is scored at the prompt's last position; the prompt takes the first sample's routing,
    and the positions where another sample's differs (as sets) are counted."""
    from moerl.trainer.batch import prefix_disagreements

    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 200, 3, dtype=np.int32)

    def sample(response_len: int, routing: np.ndarray) -> Sample:
        return Sample(
            prompt_ids=prompt,
            response_ids=rng.integers(1, 200, response_len, dtype=np.int32),
            behaviour_logprobs=np.full(response_len, -2.0, np.float32),
            versions=np.zeros(response_len, np.int64),
            routing=routing,
        ).validate()

    def routed(fed: int) -> np.ndarray:
        return np.argsort(rng.random((fed, 2, 8)), axis=-1)[..., :2].astype(np.uint8)

    first = sample(4, routed(6))
    other = routed(5)
    other[:3] = first.routing[:3]
    other[1] = first.routing[1][:, ::-1]  # the same sets in another order: not a disagreement
    other[2, 0] = (first.routing[2, 0] + 1) % 8  # a different set at prompt position 2
    agrees = routed(3)
    agrees[:] = first.routing[:3]
    samples = [first, sample(3, other), sample(1, agrees), sample(2, routed(4))]
    alone = samples[3]
    batch = build_micro_batch(
        samples, [1.0] * 4, [1.0] * 4, multiple=4, use_masks=False, routed_experts=8, packed=True, shared=[0, 3, 3, 0]
    )
    # prompt (3), responses fed 3 + 2 + 0, then the sample of its own (4): 12 positions
    assert batch.cu_seqlens.tolist() == [0, 3, 6, 8, 12]
    assert batch.tree.tolist() == [[3, 0], [2, 3], [3, 3], [4, 0]]  # the prompt's subtree holds both responses
    ids = batch.input_ids[0].tolist()
    assert ids[:3] == prompt.tolist()
    assert ids[3:6] == first.response_ids[:3].tolist() and ids[6:8] == samples[1].response_ids[:2].tolist()
    assert ids[8:12] == alone.fed_ids().tolist()
    assert batch.cols.tolist() == [2, 3, 4, 5, 2, 6, 7, 2, 10, 11]
    assert batch.targets.tolist() == [t for s in samples for t in s.response_ids.tolist()]
    inputs = batch.packed_inputs(torch.device("cpu"), thd=False)
    assert inputs["rope_positions"].tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 0, 1, 2, 3]
    assert inputs["packed_seq_params"].max_seqlen_q == 12  # what megatron-core sizes RoPE's table by
    sees = ~inputs["packed_seq_params"].dense_mask[0, 0]
    assert sees[7].nonzero().flatten().tolist() == [0, 1, 2, 6, 7]  # the second response: the prompt and itself
    assert sees[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5]
    assert sees[11].nonzero().flatten().tolist() == [8, 9, 10, 11]  # the sample of its own sees only itself
    assert np.array_equal(batch.routing[0, :3], first.routing[:3])
    assert prefix_disagreements(samples, [0, 3, 3, 0]) == 1
    assert np.array_equal(batch.routing[0, 6:8], other[3:]) and np.array_equal(batch.routing[0, 8:12], alone.routing)
    with pytest.raises(AssertionError, match="cannot attend to a shared prefix"):
        batch.packed_inputs(torch.device("cpu"), thd=True)


def test_forks_of_an_episode_are_fed_as_a_tree_each_prefix_once():
    """An episode's first sample, then samples whose prompts are its fed stream's first 6 tokens and first 4 (twice):
    the stream is split at 6 and at 4, each branch follows its prefix, and a branch sees its ancestors, never a
    sibling's tokens."""
    from moerl.trainer.batch import prefix_disagreements

    rng = np.random.default_rng(5)

    def sample(prompt: np.ndarray, response_len: int) -> Sample:
        fed = len(prompt) + response_len - 1
        return Sample(
            prompt_ids=prompt.astype(np.int32),
            response_ids=rng.integers(1, 200, response_len, dtype=np.int32),
            behaviour_logprobs=np.full(response_len, -2.0, np.float32),
            versions=np.zeros(response_len, np.int64),
            routing=np.argsort(rng.random((fed, 2, 8)), axis=-1)[..., :2].astype(np.uint8),
        ).validate()

    first = sample(np.array([1, 2, 3]), 6)
    stream = first.fed_ids()
    samples = [first, sample(stream[:6], 2), sample(stream[:4], 3), sample(stream[:4], 2)]
    for later in samples[1:]:  # their prefixes routed as the first's: what an engine's prefix cache serves
        later.routing[: later.prompt_len] = first.routing[: later.prompt_len]
    batch = build_micro_batch(
        samples, [1.0] * 4, [1.0] * 4, multiple=1, use_masks=False, routed_experts=8, packed=True, shared=[0, 6, 4, 4]
    )
    # [0, 4) | [4, 6) | the first's [6, 8) | the second's [6, 7) | the third's [4, 6) | the fourth's [4, 5)
    assert batch.cu_seqlens.tolist() == [0, 4, 6, 8, 9, 11, 12]
    assert batch.tree.tolist() == [[6, 0], [4, 4], [3, 6], [4, 6], [5, 4], [6, 4]]
    for s, (row, at) in zip(samples, [(0, [0, 1, 2, 3, 4, 5, 6, 7]), (0, [0, 1, 2, 3, 4, 5, 8]),
                                      (0, [0, 1, 2, 3, 9, 10]), (0, [0, 1, 2, 3, 11])], strict=True):  # fmt: skip
        assert batch.input_ids[row, at].tolist() == s.fed_ids().tolist()
    inputs = batch.packed_inputs(torch.device("cpu"), thd=False)
    assert inputs["rope_positions"].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 6, 4, 5, 4]
    sees = ~inputs["packed_seq_params"].dense_mask[0, 0]
    assert sees[8].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 5, 8]  # not the first's tail
    assert sees[10].nonzero().flatten().tolist() == [0, 1, 2, 3, 9, 10]
    assert sees[11].nonzero().flatten().tolist() == [0, 1, 2, 3, 11]  # not its sibling's
    assert prefix_disagreements(samples, [0, 6, 4, 4]) == 0
    samples[3].routing[2, 1] = (samples[3].routing[2, 1] + 1) % 8
    assert prefix_disagreements(samples, [0, 6, 4, 4]) == 1


def test_a_run_sharing_prefixes_is_cut_where_the_next_sample_would_pass_the_budget():
    """Units the micro-batches keep whole: a run of samples sharing prefixes, cut before the sample that would take it
    past the budget, which then starts a unit fed whole; a sample sharing nothing starts its own."""
    from moerl.trainer.batch import shared_units, unit_length

    shared, lengths = [0, 3, 3, 3, 0, 2], [10, 10, 10, 10, 6, 6]
    units = shared_units(shared, lengths, 20)
    assert units == [[0, 1], [2, 3], [4, 5]]
    assert [unit_length(u, shared, lengths) for u in units] == [17, 17, 10]
    assert shared_units(shared, lengths, 100) == [[0, 1, 2, 3], [4, 5]]
    assert shared_units(shared, lengths, 5) == [[0], [1], [2], [3], [4], [5]]  # each alone, over budget as it is
