"""The sample contract: stitching a rollout resumed across weight versions, and agent episodes' loss masks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from moerl.sample import Sample, SampleError


def _sample(prompt, response, version, routing_rows_from=0):
    r = len(response)
    fed = len(prompt) + r - 1
    return Sample(
        prompt_ids=np.array(prompt, np.int32),
        response_ids=np.array(response, np.int32),
        behaviour_logprobs=np.full(r, -float(version), np.float32),
        versions=np.full(r, version),
        selected_logprobs=np.full(r, -0.5 * version, np.float32),
        routing=np.arange(routing_rows_from, routing_rows_from + fed, dtype=np.uint8)[:, None, None].repeat(2, 2),
        mask_offsets=np.arange(r + 1, dtype=np.int64) * 2,
        mask_ids=np.stack([np.array(response), np.array(response) + 1], 1).ravel().astype(np.int32),
    ).validate()


def test_split_into_evens_out_micro_batch_counts():
    from moerl.trainer.batch import split_into

    assert split_into([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_into([[0], [1]], 4) == [[0], [1]]  # single samples cannot split: the trainer adds zero-weight copies
    assert split_into([[0, 1, 2]], 1) == [[0, 1, 2]]
    assert sorted(i for g in split_into([[5, 6, 7, 8, 9], [1, 2]], 5) for i in g) == [1, 2, 5, 6, 7, 8, 9]


def test_packing_fills_rows_up_to_the_budget():
    from moerl.trainer.batch import pack_by_budget

    lengths = [10, 7, 3, 9, 2, 30]
    groups = pack_by_budget(lengths, token_budget=20, multiple=2)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups == [[5], [0, 3], [1, 2, 4]]  # longest alone (over budget), then first fit by decreasing length
    for g in groups[1:]:
        assert -(-sum(lengths[i] for i in g) // 2) * 2 <= 20


def test_a_packed_micro_batch_lays_samples_end_to_end_and_walls_them_off():
    from moerl.trainer.batch import build_micro_batch

    samples = [_sample([1, 2, 3], [4, 5], 0), _sample([6], [7, 8, 9], 1)]
    padded = build_micro_batch(samples, [1.0, -1.0], [0.5, 0.5], multiple=4, use_masks=True, routed_experts=8)
    packed = build_micro_batch(
        samples, [1.0, -1.0], [0.5, 0.5], multiple=4, use_masks=True, routed_experts=8, packed=True
    )
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 6, 7, 8, 0]]  # fed lengths 4 and 3, padded to a multiple of 4
    assert packed.cu_seqlens.tolist() == [0, 4, 7]
    # every response token is scored at the same fed token in both forms
    assert torch.equal(padded.input_ids[padded.rows, padded.cols], packed.input_ids[packed.rows, packed.cols])
    assert torch.equal(packed.targets, padded.targets) and torch.equal(packed.mask_ids, padded.mask_ids)
    assert np.array_equal(packed.routing[0, :7], np.concatenate([s.routing for s in samples]))
    assert packed.real_positions().tolist() == [[True] * 7 + [False]]
    assert padded.real_positions().tolist() == [[True] * 4, [True] * 3 + [False]]

    inputs = packed.packed_inputs(torch.device("cpu"), thd=False)
    assert inputs["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    allowed = ~inputs["packed_seq_params"].dense_mask[0, 0]
    segment = [0, 0, 0, 0, 1, 1, 1, 2]
    expected = [[segment[q] == segment[k] and k <= q for k in range(8)] for q in range(8)]
    assert allowed.tolist() == expected
    thd = packed.packed_inputs(torch.device("cpu"), thd=True)["packed_seq_params"]
    assert thd.qkv_format == "thd" and thd.cu_seqlens_q.tolist() == [0, 4, 7, 8] and thd.max_seqlen_q == 4


# ---- agent episodes: the loss mask -----------------------------------------------------------------------------------
def _episode(**changes) -> Sample:
    """A prompt, a model turn, a tool's answer (context), a model turn; kept sets at the actions only."""
    fields = dict(
        prompt_ids=np.array([1, 2, 3], np.int32),
        response_ids=np.array([10, 11, 20, 21, 22, 12], np.int32),
        behaviour_logprobs=np.array([-1, -2, 0, 0, 0, -3], np.float32),
        versions=np.array([4, 4, -1, -1, -1, 5]),
        selected_logprobs=np.array([-0.1, -0.2, 0, 0, 0, -0.3], np.float32),
        routing=np.zeros((8, 2, 2), np.uint8),
        mask_offsets=np.array([0, 2, 4, 4, 4, 4, 6]),
        mask_ids=np.array([10, 11, 11, 12, 12, 13], np.int32),
        loss_mask=np.array([1, 1, 0, 0, 0, 1], np.uint8),
        episode=2,
    )
    return Sample(**{**fields, **changes})


def test_an_episode_sample_validates_and_tells_its_actions():
    s = _episode().validate()
    assert s.actions.tolist() == [True, True, False, False, False, True]
    assert s.action_count == 3 and s.oldest_version == 4  # the context's -1 is no version
    assert s.at_actions(s.response_ids).tolist() == [10, 11, 12]
    assert s.fed_len == 8 and s.routing.shape[0] == 8  # routing: one row per fed position, context included


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"loss_mask": np.array([1, 1, 0, 0, 1], np.uint8)}, r"loss_mask has shape \(5,\), expected \(6,\)"),
        ({"loss_mask": np.array([1, 1, 0, 0, 2, 1], np.uint8)}, "loss_mask holds values other than 0"),
        (
            {
                "loss_mask": np.zeros(6, np.uint8),
                "versions": np.full(6, -1),
                "mask_offsets": np.zeros(7, np.int64),
                "mask_ids": np.zeros(0, np.int32),
            },
            "loss_mask marks no token an action",
        ),
        ({"versions": np.array([4, -1, -1, -1, -1, 5])}, "versions holds a negative version at action token 1"),
        ({"versions": np.array([4, 4, -1, 4, -1, 5])}, "versions must hold -1 at every context token"),
        (  # an id for a context token
            {"mask_offsets": np.array([0, 2, 4, 5, 5, 5, 7]), "mask_ids": np.array([10, 11, 11, 12, 20, 12, 13])},
            "mask_offsets must give >= 1 kept id to every action and none to context tokens",
        ),
        (  # none for an action
            {"mask_offsets": np.array([0, 2, 4, 4, 4, 4, 4]), "mask_ids": np.array([10, 11, 11, 12])},
            "mask_offsets must give >= 1 kept id to every action",
        ),
        ({"mask_ids": np.array([10, 11, 11, 12, 13, 14], np.int32)}, "mask_ids: response token 5 is not in its own"),
        ({"mask_offsets": np.array([0, 2, 4, 4, 4, 4])}, r"mask_offsets must be \[R\+1\] = \[7\]"),
        ({"episode": -1}, "episode must be >= 0"),
    ],
    ids=[
        "mask shape",
        "mask values",
        "no action",
        "action version",
        "context version",
        "context kept set",
        "empty action kept set",
        "action outside its set",
        "offsets shape",
        "episode",
    ],
)
def test_an_episode_sample_refuses_each_inconsistency_naming_the_field(changes, error):
    with pytest.raises(SampleError, match=error):
        _episode(**changes).validate()


def test_single_turn_samples_are_unchanged():
    """No loss mask: every response token is an action, and a mask of all ones builds the same micro-batch."""
    from moerl.trainer.batch import build_micro_batch

    plain = _sample([1, 2, 3], [4, 5], 2)
    assert plain.loss_mask is None and plain.episode is None
    assert plain.actions.all() and plain.action_count == 2 and plain.oldest_version == 2
    assert plain.at_actions(plain.versions) is plain.versions  # no copy on the hot path
    ones = dataclasses.replace(plain, loss_mask=np.ones(2, np.uint8)).validate()
    a, b = (build_micro_batch([s], [1.0], [0.5], multiple=2, use_masks=True, routed_experts=8) for s in (plain, ones))
    for name in ("input_ids", "rows", "cols", "targets", "behaviour", "versions", "mask_offsets", "mask_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    with pytest.raises(SampleError, match="versions holds a negative version at action token 0"):
        _sample([1, 2, 3], [4, 5], -1)
