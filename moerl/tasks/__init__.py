"""Prompt datasets, named in config (the ``task`` section) with their reward functions (:mod:`moerl.rewards`).

A task is a list of records ``{"prompt": str, "answer": ...}`` and a reward function. Built in:
``tiny`` (the CPU demo's addition task), ``calc`` (the CPU agent demo's: products to compute with a
calculator tool), ``sums`` (the CPU process-reward demo's: running sums written a step a line), ``gsm8k``
(grade-school math checked by math-verify; a small sample ships, point ``path`` at the full set), and ``file`` (local
jsonl or parquet, with the reward named in config).
Prompts are served in a seeded order that reshuffles every epoch, addressed by a global index, so a
run can be resumed from a position and in-flight prompts re-issued exactly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moerl.choices import ConfigError, check_choices

DATA_DIR = Path(__file__).parent / "data"
TaskName = Literal["tiny", "calc", "sums", "gsm8k", "file"]
# task -> its default reward
TASKS: dict[TaskName, str] = {"tiny": "tiny", "calc": "calc", "sums": "sums", "gsm8k": "math", "file": "exact"}
# The CPU demos' tiny models (run without model.path), each warmed up on its task's format once and cached:
# task -> (its directory in run.cache_dir, what builds it)
DEMO_MODELS: dict[TaskName, tuple[str, str]] = {
    "tiny": ("tiny-qwen3-moe-addition-v2", "moerl.tasks.tiny:save_warm_tiny_model"),
    "calc": ("tiny-qwen3-moe-calc-v3", "moerl.tasks.calc:save_warm_calc_model"),
    "sums": ("tiny-qwen3-moe-sums-v1", "moerl.tasks.sums:save_warm_sums_model"),
}
DEMO = "demo"  # a scorer's model (reward.model, teacher.model): the task's demo one


@dataclass(frozen=True)
class DemoScorers:
    """A scorer section's CPU demo models (``<section>.model=demo``), made once and cached as the demo models are: by
    task, (its directory in run.cache_dir, what builds it), all of one architecture, built with every layer sparse
    (``moerl.models.tiny.ALL_SPARSE``, as the demo policy is) or not."""

    models: dict[TaskName, tuple[str, str]]
    architecture: str
    all_sparse: bool


DEMO_SCORERS: dict[str, DemoScorers] = {
    # a tiny sequence classifier warmed up on the task's right and wrong answers
    "reward": DemoScorers(
        {"tiny": ("tiny-qwen3-reward-addition-v2", "moerl.tasks.tiny:save_tiny_reward_model")},
        "Qwen3ForSequenceClassification",
        all_sparse=False,
    ),
    # a tiny token classifier trained on the task's right and wrong steps, each followed by its step token
    "reward.process": DemoScorers(
        {"sums": ("tiny-qwen3-prm-sums-v3", "moerl.tasks.sums:save_tiny_prm")},
        "Qwen3ForTokenClassification",
        all_sparse=False,
    ),
    # the demo model's architecture and tokenizer, trained longer on right answers only, so that it is better at the
    # task than the student it teaches
    "teacher": DemoScorers(
        {"tiny": ("tiny-qwen3-moe-addition-teacher-v1", "moerl.tasks.tiny:save_tiny_teacher")},
        "Qwen3MoeForCausalLM",
        all_sparse=True,
    ),
}


@dataclass
class TaskConfig:
    name: TaskName = "tiny"
    path: str | None = None  # jsonl or parquet records (file; gsm8k: instead of the shipped sample)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    reward: str | None = None  # built-in (moerl.rewards.rules) or "package.module:function"; default: the task's own
    reward_url: str | None = None  # a remote verifier instead: POST {prompt, response, answer} -> {"reward": float}
    group_reward: bool = False  # the reward function scores a whole group: f(responses, answer, prompt) -> list
    system_prompt: str | None = None  # with a chat template: the system message
    chat_template: bool = False  # wrap prompts in the tokenizer's chat template
    shuffle: bool = True
    seed: int = 0

    def __post_init__(self):
        check_choices(self, "task")
        if self.name == "file" and not self.path:
            raise ConfigError("task.name=file needs task.path (a .jsonl or .parquet file of records)")


def read_records(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer") -> list[dict[str, Any]]:
    """Records of a local jsonl or parquet file as ``{"prompt", "answer"}`` dicts."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"task.path={path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"task.path={path}:{n}: not a JSON object ({e})") from None
    else:
        raise ConfigError(f"task.path={path}: expected a .jsonl or .parquet file")
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"task.path={path}: record {n} is {type(row).__name__}, not a JSON object")
        missing = [k for k in (prompt_key, answer_key) if k not in row]
        if missing:
            raise ConfigError(
                f"task.path={path}: record {n} has no {', '.join(missing)} (keys: {', '.join(row)}); set "
                "task.prompt_key/answer_key"
            )
    if not rows:
        raise ConfigError(f"task.path={path}: no records")
    return [{"prompt": row[prompt_key], "answer": row[answer_key]} for row in rows]


def load_records(cfg: TaskConfig) -> list[dict[str, Any]]:
    if cfg.name == "tiny":
        from moerl.tasks import tiny

        return tiny.records()
    if cfg.name == "calc":
        from moerl.tasks import calc

        return calc.records()
    if cfg.name == "sums":
        from moerl.tasks import sums

        return sums.records()
    path = cfg.path or DATA_DIR / "gsm8k_sample.jsonl"  # gsm8k without a path: the shipped sample
    return read_records(path, cfg.prompt_key, cfg.answer_key)


class PromptStream:
    """The task's prompts in a seeded order, a fresh permutation each epoch; ``get(i)`` is the i-th prompt
    of the whole run (deterministic, so resumed runs and re-issued prompts see the same data)."""

    def __init__(self, cfg: TaskConfig, tokenizer):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.records = load_records(cfg)
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.records)

    def record(self, index: int) -> dict[str, Any]:
        epoch, position = divmod(index, len(self.records))
        if epoch not in self._orders:
            n = len(self.records)
            self._orders = {
                epoch: np.random.default_rng([self.cfg.seed, epoch]).permutation(n)
                if self.cfg.shuffle
                else np.arange(n)
            }
        return self.records[int(self._orders[epoch][position])]

    def get(self, index: int) -> tuple[dict[str, Any], list[int]]:
        """The record and its prompt token ids."""
        record = self.record(index)
        if self.cfg.chat_template:
            messages = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
            messages.append({"role": "user", "content": record["prompt"]})
            ids = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        else:
            ids = self.tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        return record, list(ids)
