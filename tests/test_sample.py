"""The sample contract: stitching a rollout resumed across weight versions."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.sample import Sample, SampleError


def _sample(prompt, response, version, routing_rows_from=0):
    r = len(response)
    fed = len(prompt) + r - 1
    return Sample(
        prompt_ids=np.array(prompt, np.int32), response_ids=np.array(response, np.int32),
        behaviour_logprobs=np.full(r, -float(version), np.float32), versions=np.full(r, version),
        selected_logprobs=np.full(r, -0.5 * version, np.float32),
        routing=np.arange(routing_rows_from, routing_rows_from + fed, dtype=np.uint8)[:, None, None].repeat(2, 2),
        mask_offsets=np.arange(r + 1, dtype=np.int64) * 2, mask_ids=np.stack([np.array(response), np.array(response) + 1], 1).ravel().astype(np.int32),
    ).validate()


def test_a_resumed_rollout_keeps_what_produced_each_token():
    first = _sample([1, 2, 3], [10, 11], version=4)  # fed positions 0..3
    continuation = _sample([1, 2, 3, 10, 11], [12, 13, 14], version=5, routing_rows_from=100)  # fed 0..6
    joined = first.continued_by(continuation)
    assert joined.response_ids.tolist() == [10, 11, 12, 13, 14]
    assert joined.versions.tolist() == [4, 4, 5, 5, 5]
    assert joined.behaviour_logprobs.tolist() == [-4, -4, -5, -5, -5]
    # positions 0..3 were fed by the first engine; 4.. (token 11 onwards) by the continuation's prefill/decode
    assert joined.routing[:, 0, 0].tolist() == [0, 1, 2, 3, 104, 105, 106]
    assert joined.kept_ids(2).tolist() == [12, 13] and joined.kept_ids(1).tolist() == [11, 12]
    assert joined.fed_len == 7


def test_a_continuation_of_another_prompt_is_refused():
    with pytest.raises(SampleError, match="prompt must be this sample's prompt"):
        _sample([1, 2, 3], [10, 11], 4).continued_by(_sample([1, 2, 3, 10], [12], 5))


def test_split_into_evens_out_micro_batch_counts():
    from moerl.trainer.batch import split_into

    assert split_into([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert split_into([[0], [1]], 4) == [[0], [1]]  # single samples cannot split: the trainer adds zero-weight copies
    assert split_into([[0, 1, 2]], 1) == [[0, 1, 2]]
    assert sorted(i for g in split_into([[5, 6, 7, 8, 9], [1, 2]], 5) for i in g) == [1, 2, 5, 6, 7, 8, 9]
