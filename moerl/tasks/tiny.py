"""The built-in tiny task of the CPU demo: small-digit addition ("3+4=" -> "7") for the tiny
character-level Qwen3-MoE, and the brief supervised warm-up that makes it start above zero reward.

A random tiny model never emits a number and its end token; GRPO learns nothing from a group whose
rewards are all zero. A short supervised pass on the format (answers drawn mostly at random, a few
correct) leaves the model answering with a digit string and stopping, right some of the time: the
reward starts low but above zero, and what RL then improves is correctness, not format.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from moerl.models.tiny import ALL_SPARSE, save_model, save_tiny_hf

DIGITS = 5  # 25 prompts: a few minutes of CPU GRPO take the tiny model from ~0.4 to ~1.0


def records() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(DIGITS) for b in range(DIGITS)]


def reward(response: str, answer: str, prompt: str = "") -> float:
    """1 for the exact sum; 0 otherwise."""
    return float(response.strip() == answer)


def warm_up(model, tokenizer, steps: int = 150, correct_fraction: float = 0.3, seed: int = 0, lr: float = 3e-3) -> None:
    """Supervised format training: each example's answer is right with ``correct_fraction``, else a random sum."""
    items = records()

    def answer(rng: random.Random, item: dict) -> str:
        return item["answer"] if rng.random() < correct_fraction else str(rng.randrange(2 * DIGITS - 1))

    fit_answers(model, tokenizer, items, answer, steps, seed, lr)


def fit_answers(
    model, tokenizer, items: list[dict], answer: Callable[[random.Random, dict], str], steps: int, seed: int, lr: float
) -> None:
    """Supervised training on ``answer(rng, item)`` after each of ``items``' prompts and the end token, 32 a step, the
    loss on the answers alone: a demo model's format warm-up."""
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = []
        for item in rng.choices(items, k=32):
            text = answer(rng, item)
            prompt = tokenizer(item["prompt"], add_special_tokens=False)["input_ids"]
            full = prompt + tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            batch.append((full, len(prompt)))
        width = max(len(f) for f, _ in batch)
        ids = torch.full((len(batch), width), eos)
        labels = torch.full((len(batch), width), -100)
        for i, (full, p) in enumerate(batch):
            ids[i, : len(full)] = torch.tensor(full)
            labels[i, p : len(full)] = torch.tensor(full[p:])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def accuracy(model, tokenizer) -> float:
    """Greedy exact-match accuracy over all prompts."""
    hits = 0
    for item in records():
        ids = tokenizer(item["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids,
                max_new_tokens=3,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
        hits += reward(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True), item["answer"]) > 0
    return hits / len(records())


def save_warm_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3-MoE with its tokenizer, warmed up on the task's format, as a HF directory."""
    from transformers import AutoModelForCausalLM

    return save_warmed("Qwen3MoeForCausalLM", AutoModelForCausalLM, warm_up, out_dir, seed, **ALL_SPARSE)


def save_tiny_teacher(out_dir: str | Path, seed: int = 1) -> Path:
    """The demo model's architecture and tokenizer trained four times as long on right answers only: a teacher better
    at the task than the student (``teacher.model=demo``), with weights of its own (another seed)."""
    from transformers import AutoModelForCausalLM

    def warm(model, tokenizer, seed: int) -> None:
        warm_up(model, tokenizer, steps=600, correct_fraction=1.0, seed=seed)

    return save_warmed("Qwen3MoeForCausalLM", AutoModelForCausalLM, warm, out_dir, seed, **ALL_SPARSE)


def reward_examples(rng: random.Random, k: int, tokenizer) -> list[tuple[list[int], float]]:
    """``k`` conversations of the task, scored as a reward model reads them
    (:meth:`~moerl.rewards.model.Classifier.conversation_ids`): half answered right (label 1), half with another sum
    (label 0)."""
    examples = []
    for item in rng.choices(records(), k=k):
        right = rng.random() < 0.5
        answer = (
            item["answer"] if right else str(rng.choice([s for s in range(2 * DIGITS - 1) if str(s) != item["answer"]]))
        )
        messages = [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": answer}]
        examples.append((list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)), float(right)))
    return examples


def warm_up_reward_model(model, tokenizer, steps: int = 800, seed: int = 0, lr: float = 1e-3) -> None:
    """Train a sequence-classification model to score a right answer above a wrong one (logistic loss on its one
    logit)."""
    rng = random.Random(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id
    model.train()
    for _ in range(steps):
        batch = reward_examples(rng, 32, tokenizer)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([label for _, label in batch])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(input_ids=ids).logits[:, 0], labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def save_tiny_reward_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3 sequence-classification model with its tokenizer, warmed up to tell the task's right answers from
    wrong ones, as a HF directory: the CPU demo's reward model (``reward.model=demo``)."""
    from transformers import AutoModelForSequenceClassification

    return save_warmed(
        "Qwen3ForSequenceClassification", AutoModelForSequenceClassification, warm_up_reward_model, out_dir, seed
    )


def save_warmed(architecture: str, auto_class, warm, out_dir: str | Path, seed: int, **overrides) -> Path:
    """A tiny model of ``architecture`` (its config changed by ``overrides``) saved to ``out_dir``, loaded by
    ``auto_class``, ``warm(model, tokenizer, seed=seed)`` and saved again."""
    from transformers import AutoTokenizer

    out = save_tiny_hf(architecture, out_dir, seed=seed, **overrides)
    model = auto_class.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    warm(model, tokenizer, seed=seed)
    save_model(model, out)
    return out
