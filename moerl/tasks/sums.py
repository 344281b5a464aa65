"""The built-in sums task of the CPU process-reward demo: four small digits to add ("1+3+2+0=") with the running sum
written a line at a time ("4\\n6\\n6"), each line a step (``reward.process.separator="\\n"``). The outcome is the last
line, where the response has a line for every running sum; a step is right where its line is the running sum so far.

As with the tiny task (:mod:`moerl.tasks.tiny`), a short supervised warm-up on the format leaves the tiny model
writing three lines and stopping, each line right some of the time, so both the outcome and the steps start above
zero. The demo's process reward model (:func:`save_tiny_prm`) is a tiny token classifier trained beforehand on the
task's steps, right and wrong, read as the Qwen2.5-Math-PRM convention reads them (each step followed by a step token).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

from moerl.models.tiny import ALL_SPARSE, save_model, save_tiny_hf
from moerl.rewards.score import Score, text_steps
from moerl.tasks.tiny import fit_answers, save_warmed

TERMS, DIGITS = 4, 4  # 256 prompts: 0-3 four times
SEPARATOR = "\n"
PRM_LINES = (1, 2, 3, 3, 3, 4)  # the demo PRM's training answers' lines: mostly the task's three
STEP_TOKEN = "<extra_0>"  # what the demo's process reward model reads after each step (Qwen2.5-Math-PRM's)


def records() -> list[dict[str, Any]]:
    prompts = [[a, b, c, d] for a in range(DIGITS) for b in range(DIGITS) for c in range(DIGITS) for d in range(DIGITS)]
    return [{"prompt": "+".join(map(str, t)) + "=", "answer": str(sum(t))} for t in prompts]


def running_sums(prompt: str) -> list[str]:
    """The right steps of a prompt: each running sum from the second term on."""
    terms = [int(x) for x in prompt.rstrip("=").split("+")]
    return [str(sum(terms[: k + 1])) for k in range(1, len(terms))]


def reward(response: str, answer: Any, prompt: str = "") -> float:
    """1 where the response shows its work (a line per running sum, ``TERMS - 1`` of them) and the last is the sum; 0
    otherwise: a bare total is no answer here, as a proof without steps is none."""
    steps = text_steps(response, SEPARATOR)
    return float(len(steps) == TERMS - 1 and steps[-1].strip() == str(answer))


def step_reward(response: str, answer: Any, prompt: str = "") -> Score:
    """The outcome (:func:`reward`) and each step's exact score: 1 where its line is the running sum so far (a rule in
    place of a process reward model: ``task.reward=sums_steps``)."""
    right = running_sums(prompt)
    steps = text_steps(response, SEPARATOR)
    return Score(
        reward(response, answer),
        [float(k < len(right) and s.strip() == right[k]) for k, s in enumerate(steps)],
    )


def _answer(rng: random.Random, prompt: str, right_fraction: float, lines: int = TERMS - 1) -> list[str]:
    """``lines`` steps, each the running sum (where there is one) with ``right_fraction``, else another number in the
    sums' range."""
    top = (DIGITS - 1) * TERMS
    right = running_sums(prompt)
    steps = []
    for k in range(lines):
        s = right[k] if k < len(right) else None
        steps.append(
            s if s and rng.random() < right_fraction else str(rng.choice([x for x in range(top + 1) if str(x) != s]))
        )
    return steps


def warm_up(model, tokenizer, steps: int = 300, seed: int = 0, lr: float = 3e-3, right_fraction: float = 0.5) -> None:
    """Supervised format training: the steps' lines, each right with ``right_fraction``, and the end token."""

    def answer(rng: random.Random, item: dict) -> str:
        return SEPARATOR.join(_answer(rng, item["prompt"], right_fraction))

    fit_answers(model, tokenizer, records(), answer, steps, seed, lr)


def save_warm_sums_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE with its tokenizer, warmed up on the sums format, as a HF directory (the demo's policy)."""
    from transformers import AutoModelForCausalLM

    return save_warmed("Qwen3MoeForCausalLM", AutoModelForCausalLM, warm_up, out_dir, seed, **ALL_SPARSE)


def prm_example(tokenizer, prompt: str, steps: list[str]) -> tuple[list[int], list[float]]:
    """What the process reward model reads of ``steps`` (as :meth:`~moerl.rewards.process.ProcessRewardModel.input_ids`
    builds it) and each step's label: 1 where it is the running sum (a line past the last running sum is wrong)."""
    answer = "".join(s + STEP_TOKEN for s in steps)
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    ids = list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))
    right = running_sums(prompt)
    return ids, [float(k < len(right) and s == right[k]) for k, s in enumerate(steps)]


def warm_up_prm(model, tokenizer, steps: int = 800, seed: int = 0, lr: float = 3e-3) -> None:
    """Train a token classifier to tell a right step from a wrong one at the step token after it (cross-entropy over its
    two labels there; every other position unlabelled), on answers of one to ``TERMS`` lines: a policy's answer may
    stop early or run on, and a model that never saw one would score it arbitrarily. The learning rate decays linearly
    to zero: after 800 steps it scores 99% of three-line answers' steps right (:func:`prm_accuracy`), where 1,500 at a
    constant rate scored 95-98% (seeds 0-2)."""
    rng = random.Random(seed)
    items = records()
    step_id = tokenizer.convert_tokens_to_ids(STEP_TOKEN)
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    model.train()
    for _ in range(steps):
        batch = [
            prm_example(tokenizer, x["prompt"], _answer(rng, x["prompt"], 0.5, rng.choice(PRM_LINES)))
            for x in rng.choices(items, k=32)
        ]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), pad)
        labels = torch.full((len(batch), width), -100)
        for i, (x, right) in enumerate(batch):
            ids[i, : len(x)] = torch.tensor(x)
            at = [k for k, t in enumerate(x) if t == step_id]
            labels[i, at] = torch.tensor(right, dtype=torch.long)
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval()


def prm_accuracy(model, tokenizer, samples: int = 512, seed: int = 1) -> float:
    """The share of steps (half of them right) whose score is on the right side of one half."""
    rng = random.Random(seed)
    step_id = tokenizer.convert_tokens_to_ids(STEP_TOKEN)
    hits = total = 0
    for item in rng.choices(records(), k=samples // 3):
        ids, right = prm_example(tokenizer, item["prompt"], _answer(rng, item["prompt"], 0.5))
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)[:, 1]
        scores = probs[[k for k, t in enumerate(ids) if t == step_id]]
        hits += sum((s > 0.5) == (r > 0.5) for s, r in zip(scores.tolist(), right, strict=True))
        total += len(right)
    return hits / total


def save_tiny_prm(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3 token classifier with the demo tokenizer and its step token, trained to score the sums task's steps,
    as a HF directory: the demo's process reward model (``reward.process.model=demo``)."""
    from transformers import AutoModelForTokenClassification, AutoTokenizer

    out = save_tiny_hf("Qwen3ForTokenClassification", out_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens([STEP_TOKEN], special_tokens=True)
    tokenizer.save_pretrained(out)
    model = AutoModelForTokenClassification.from_pretrained(out, dtype=torch.float32)
    torch.manual_seed(seed)
    warm_up_prm(model, tokenizer, seed=seed)
    save_model(model, out)
    return out
