"""Process rewards on the rollout side: responses cut into steps at a separator (hand-made token streams), the reward
function's step scores attached, the sums task's rules, the metrics of a batch's steps, and the config's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from moerl.errors import ConfigError
from moerl.orchestrator.config import RunConfig, check
from moerl.orchestrator.rollouts import process_metrics
from moerl.rewards.model import ScorerError
from moerl.rewards.process import ProcessRewards, StepCutter
from moerl.rewards.score import Score, text_steps
from moerl.sample import Sample
from moerl.tasks import sums


class Vocabulary:
    """A tokenizer of hand-made tokens, each decoding to its text; ``<eos>`` is special (decoded as nothing)."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens

    def ids(self, *texts: str) -> np.ndarray:
        return np.array([self.tokens.index(t) for t in texts], dtype=np.int32)

    def batch_decode(self, batch, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return ["" if self.tokens[i] == "<eos>" and skip_special_tokens else self.tokens[i] for (i,) in batch]


VOCAB = Vocabulary(["<eos>", "Add", " 3", ".", "\n\n", ".\n\n", "\n\nSo", " 7", "\n", "Done", "ab", "\n\n\n\n"])


@pytest.mark.parametrize(
    "tokens, ends",
    [
        # a separator token of its own ends its step; the end token after the last separator joins the step before
        (["Add", " 3", "\n\n", "Add", " 7", "\n\n", "<eos>"], [3, 7]),
        # a separator inside a token, at its end (".\n\n") or before text it holds ("\n\nSo": that text stays before)
        (["Add", ".\n\n", "Done", "\n\nSo", " 7", "."], [2, 4, 6]),
        # doubled separators (one token, and two tokens) make no empty step; a leading one joins the first step
        (["\n\n", "Add", "\n\n\n\n", "Done", "\n\n", "\n\n", "ab"], [3, 6, 7]),
        # a response cut by its token budget: its last step ends at the last token, without a separator
        (["Add", "\n\n", "Add", " 3"], [2, 4]),
        # no separator: one step; nothing but separators: one step
        (["Add", " 3"], [2]),
        (["\n\n", "\n\n"], [2]),
    ],
)
def test_a_response_is_cut_into_steps_at_its_separator(tokens, ends):
    cutter = StepCutter(VOCAB, "\n\n")
    ids = VOCAB.ids(*tokens)
    assert cutter.ends(ids).tolist() == ends
    sample = Sample(ids[:1], ids, np.zeros(len(ids), np.float32), np.zeros(len(ids), np.int64))
    sample.step_ends = cutter.ends(ids)
    texts = cutter.texts(sample.validate())
    assert len(texts) == len(ends)
    # a reward function cutting the text counts the steps moerl cut (a token holding text after a separator aside)
    if "\n\nSo" not in tokens:
        assert text_steps("".join(VOCAB.batch_decode([[i] for i in ids])), "\n\n") == texts or ends == [2]


def test_text_steps_drops_empty_pieces_and_keeps_a_text_without_separators_whole():
    assert text_steps("a\n\n\n\nb\n\n", "\n\n") == ["a", "b"]
    assert text_steps("\n\na", "\n\n") == ["a"]
    assert text_steps("abc", "\n\n") == ["abc"]
    with pytest.raises(ValueError, match="separator is empty"):
        StepCutter(VOCAB, "")


def _single_turn(tokens: list[str], reward: float = 1.0, group: int = 0) -> Sample:
    ids = VOCAB.ids(*tokens)
    n = len(ids)
    return Sample(ids[:1], ids, np.zeros(n, np.float32), np.zeros(n, np.int64), reward=reward, group_id=group)


def test_a_reward_functions_step_scores_attach_to_the_steps_it_counted():
    rewards = ProcessRewards(StepCutter(VOCAB, "\n\n"), None, cut_all=False)
    plain = _single_turn(["Add", "\n\n", "Done"])
    rewards.attach([plain], None, "task.reward=f")  # outcome-only credit, no step scores: not cut
    assert plain.step_ends is None and plain.step_rewards is None
    scored = _single_turn(["Add", "\n\n", "Done"])
    rewards.attach([scored], [0.25, 1.0], "task.reward=f")
    assert scored.step_ends.tolist() == [2, 3] and scored.step_rewards.tolist() == [0.25, 1.0]
    with pytest.raises(ScorerError, match=r"task.reward=f returned 3 step scores for a response of 2 steps"):
        rewards.attach([_single_turn(["Add", "\n\n", "Done"])], [1.0, 1.0, 1.0], "task.reward=f")
    episode = _single_turn(["Add", "\n\n", "Done"])
    episode.loss_mask = np.array([1, 0, 1], np.uint8)
    with pytest.raises(ScorerError, match="steps are its turns"):
        rewards.attach([episode], [1.0], "task.reward=f")
    every = ProcessRewards(StepCutter(VOCAB, "\n\n"), None, cut_all=True)
    cut = _single_turn(["Add", "\n\n", "Done"])
    every.attach([cut], None, "task.reward=f")  # the trainer's credit reads steps: every response is cut
    assert cut.step_ends.tolist() == [2, 3] and cut.step_rewards is None


def test_the_sums_task_scores_its_outcome_and_each_running_sum():
    record = sums.records()[27]  # 0+1+2+3
    assert record == {"prompt": "0+1+2+3=", "answer": "6"}
    assert sums.running_sums(record["prompt"]) == ["1", "3", "6"]
    assert sums.step_reward("1\n3\n6", "6", record["prompt"]) == Score(1.0, [1.0, 1.0, 1.0])
    assert sums.step_reward("1\n4\n6", "6", record["prompt"]) == Score(1.0, [1.0, 0.0, 1.0])
    assert sums.step_reward("2\n3\n5\n6", "6", record["prompt"]) == Score(0.0, [0.0, 1.0, 0.0, 0.0])  # a line too many
    assert sums.step_reward("6", "6", record["prompt"]) == Score(0.0, [0.0])  # a bare total: no work shown
    assert len(sums.records()) == sums.DIGITS**sums.TERMS


def test_process_metrics_count_steps_their_mean_and_their_correlation_with_the_outcome():
    a, b = _single_turn(["Add", "\n\n", "Done"], reward=1.0), _single_turn(["Add"], reward=0.0)
    a.step_ends, a.step_rewards = np.array([2, 3]), np.array([1.0, 0.5], np.float32)
    b.step_rewards = np.array([0.0], np.float32)
    metrics = process_metrics([a, b, _single_turn(["Add"])])  # one without step scores: left out
    assert metrics["process/steps_mean"] == 1.5
    assert metrics["process/step_reward_mean"] == pytest.approx(0.5)
    expected = np.corrcoef([1.0, 0.5, 0.0], [1.0, 1.0, 0.0])[0, 1]
    assert metrics["process/outcome_correlation"] == pytest.approx(expected)
    assert process_metrics([_single_turn(["Add"])]) == {}


def test_a_process_reward_model_is_refused_on_sglang_with_the_reason():
    cfg = RunConfig()
    cfg.reward.process.model = "demo"
    cfg.task.name = "sums"
    cfg.reward.process.engines.server = "sglang"
    with pytest.raises(ConfigError, match="SGLang 0.5.23 serves no per-token head"):
        check(cfg)
    cfg.reward.process.engines.server = "embedded"
    cfg.reward.process.separator = ""
    with pytest.raises(ConfigError, match="reward.process.separator is empty"):
        check(cfg)
