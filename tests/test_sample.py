"""The sample contract: stitching a rollout resumed across weight versions."""

from __future__ import annotations

import numpy as np
import torch

from moerl.sample import Sample


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
    allowed = ~inputs["attention_mask"][0, 0]
    segment = [0, 0, 0, 0, 1, 1, 1, 2]
    expected = [[segment[q] == segment[k] and k <= q for k in range(8)] for q in range(8)]
    assert allowed.tolist() == expected
    thd = packed.packed_inputs(torch.device("cpu"), thd=True)["packed_seq_params"]
    assert thd.qkv_format == "thd" and thd.cu_seqlens_q.tolist() == [0, 4, 7, 8] and thd.max_seqlen_q == 4
