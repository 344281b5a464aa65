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
        # a separator inside a token, at its end (".\n\n": the step ends after it) or before text it holds ("\n\nSo":
        # the next step starts with it)
        (["Add", ".\n\n", "Done", "\n\nSo", " 7", "."], [2, 3, 6]),
        (["Add", "\n\nSo"], [1, 2]),
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
    # a reward function cutting the text counts the steps moerl cut
    assert len(text_steps("".join(VOCAB.batch_decode([[i] for i in ids])), "\n\n")) == len(ends)


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
    rewards = ProcessRewards(StepCutter(VOCAB, "\n\n"), None, credit=False)
    plain = _single_turn(["Add", "\n\n", "Done"])
    rewards.attach([plain], None, "task.reward=f")  # outcome-only credit, no step scores: not cut
    assert plain.step_ends is None and plain.step_rewards is None
    scored = _single_turn(["Add", "\n\n", "Done"])
    rewards.attach([scored], [0.25, 1.0], "task.reward=f")
    assert scored.step_ends.tolist() == [2, 3] and scored.step_rewards.tolist() == [0.25, 1.0]
    with pytest.raises(ScorerError, match=r"task.reward=f returned 3 step scores for a response of 2 steps"):
        rewards.attach([_single_turn(["Add", "\n\n", "Done"])], [1.0, 1.0, 1.0], "task.reward=f")
    episode = _single_turn(["Add", "\n\n", "Done"])
    episode.episode = 0
    with pytest.raises(ScorerError, match="steps are its turns"):
        rewards.attach([episode], [1.0], "task.reward=f")
    credit = ProcessRewards(StepCutter(VOCAB, "\n\n"), None, credit=True)
    cut = _single_turn(["Add", "\n\n", "Done"])
    credit.attach([cut], [0.0, 1.0], "task.reward=f")  # the trainer's credit reads steps: every response is cut
    assert cut.step_ends.tolist() == [2, 3] and cut.step_rewards.tolist() == [0.0, 1.0]
    with pytest.raises(ScorerError, match=r"task.reward=f gave a response no step scores, and trainer.loss.credit"):
        credit.attach([_single_turn(["Add", "\n\n", "Done"])], None, "task.reward=f")
    # an episode's turns its environment never scored count 0 (an environment scores the turns it has a word for)
    episode = _single_turn(["Add", "\n\n", "Done"])
    episode.episode, episode.step_ends = 0, np.array([2, 3])
    credit.attach([episode], None, "task.reward=f")
    assert episode.step_ends.tolist() == [2, 3] and episode.step_rewards.tolist() == [0.0, 0.0]


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


def test_a_reward_functions_step_scores_are_numbers_one_a_step_or_it_is_named():
    assert Score.of(Score(1, (0, 1)), "f") == Score(1.0, [0.0, 1.0]) and Score.of(np.float32(2), "f") == Score(2.0)
    assert Score.of(Score(1, np.array([0.5])), "f") == Score(1.0, [0.5])
    for bad, error, said in (
        (Score(1.0, 0.5), TypeError, "returned steps=0.5: one number per step"),
        (Score(1.0, "ab"), TypeError, "returned steps='ab'"),
        (Score(1.0, [[1.0]]), TypeError, "one number per step"),
        (Score(1.0, [1.0, float("nan")]), ValueError, "returned a step score that is not finite"),
        ("x", TypeError, "returned str, not a number or a Score"),
    ):
        with pytest.raises(error, match=f"task.reward=f {said}" if said.startswith("returned") else said):
            Score.of(bad, "task.reward=f")


def test_group_and_remote_rewards_may_score_steps_too():
    import asyncio

    from aiohttp import web

    from moerl.rewards import Rewarder
    from moerl.tasks import TaskConfig
    from tests.engine_server import serving

    group = TaskConfig(name="sums", reward="tests.tasks.test_process_rewards:group_steps", group_reward=True)
    scores = asyncio.run(Rewarder(group).score(["1\n3\n6", "2"], "6", "0+1+2+3="))
    assert scores == [Score(1.0, [1.0, 1.0, 1.0]), Score(0.0, [0.0])]

    async def remote():
        async def verify(request):
            body = await request.json()
            return web.json_response({"reward": 1.0, "steps": [0.5] * len(text_steps(body["response"], "\n"))})

        async with serving({("POST", "/verify"): verify}) as url:
            rewarder = Rewarder(TaskConfig(name="sums", reward_url=f"{url}/verify"))
            try:
                return await rewarder.score(["1\n3", "6"], "6", "0+1+2+3=")
            finally:
                await rewarder.close()

    assert asyncio.run(remote()) == [Score(1.0, [0.5, 0.5]), Score(1.0, [0.5])]


def group_steps(responses, answer, prompt=""):
    return [sums.step_reward(r, answer, prompt) for r in responses]


def test_the_preflight_refuses_a_process_reward_model_it_cannot_serve_and_one_in_the_wrong_section(tmp_path):
    from moerl.models.tiny import save_tiny_hf
    from moerl.orchestrator.preflight import check_process, check_reward, check_teacher

    prm = save_tiny_hf("Qwen3ForTokenClassification", tmp_path / "prm")  # its tokenizer has no <extra_0>
    cfg = RunConfig()
    cfg.reward.process.model = str(prm)
    with pytest.raises(ConfigError, match=r"step_token='<extra_0>' is 9 tokens in .*prm's tokenizer; it must be one"):
        check_process(cfg)
    cfg.reward.process.step_token = "\n"  # one token of the tiny tokenizer
    check_process(cfg)
    cfg.reward.process.model = str(save_tiny_hf("Qwen3ForTokenClassification", tmp_path / "three", num_labels=3))
    with pytest.raises(ConfigError, match="has 3 labels: a process reward model's head has 2"):
        check_process(cfg)
    cfg.reward.process.model = str(save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "classifier"))
    with pytest.raises(ConfigError, match=r"token-classification head \(\*ForTokenClassification\)"):
        check_process(cfg)
    cfg = RunConfig()
    cfg.reward.model = str(prm)
    with pytest.raises(ConfigError, match="is a process reward model .* serve it as reward.process.model"):
        check_reward(cfg)
    cfg = RunConfig()
    cfg.teacher.model = str(prm)
    cfg.trainer.loss.distill.coef = 0.1
    with pytest.raises(ConfigError, match="is a classifier .*: a teacher scores tokens"):
        check_teacher(cfg)
