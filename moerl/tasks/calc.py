"""The built-in calc task of the CPU agent demo: products of two digits ("7*8" -> "56"), which the tiny
character-level model cannot compute, so it must call the calculator tool, read its answer and give it back.

As with the tiny task (:mod:`moerl.tasks.tiny`), a random model never calls a tool: a short supervised warm-up on the
format (rendered with the tokenizer's own chat template, so it sees exactly what an episode shows it) teaches it both
ways to answer: half its examples call the calculator and repeat its result, half answer at once with a guess. The
reward starts near half the tool's accuracy, and what RL learns is to use the tool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from moerl.episodes.tools import Tool, calculator
from moerl.models.tiny import ALL_SPARSE, save_tiny_hf

FACTORS = range(2, 10)  # 64 prompts
# The calculator with a terse schema: the chat template lists it in every prompt, and the tiny model reads characters.
CALC = Tool(
    name="calc",
    fn=calculator,
    description="a*b",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
)
TOOLS = [CALC.schema()]


def records() -> list[dict[str, Any]]:
    # two turns do it (the call, the answer); a third lets a model that called twice still answer
    return [{"prompt": f"{a}*{b}", "answer": str(a * b), "max_turns": 3} for a in FACTORS for b in FACTORS]


def reward(response: str, answer: Any, prompt: str = "") -> float:
    """1 for the exact product as the final answer; 0 otherwise."""
    return float(response.strip() == str(answer))


def conversation(prompt: str, guess: str | None = None) -> list[dict[str, Any]]:
    """An episode a warmed-up model plays: call the calculator on the prompt and answer with what it returned, or, with
    a ``guess``, answer that at once."""
    user = {"role": "user", "content": prompt}
    if guess is not None:
        return [user, {"role": "assistant", "content": guess}]
    result = CALC.fn(expression=prompt)
    arguments = json.dumps({"expression": prompt})
    call = {"id": "call_0", "type": "function", "function": {"name": CALC.name, "arguments": arguments}}
    return [
        user,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "name": CALC.name, "content": result},
        {"role": "assistant", "content": result},
    ]


def _ids(tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def labelled(tokenizer, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The rendered conversation and its labels: the assistant turns' tokens through their end-of-turn token (what the
    model generates), -100 elsewhere."""
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids: list[int] = []
    labels: list[int] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:k], generation_prompt=True)
        after = _ids(tokenizer, messages[: k + 1], generation_prompt=False)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            raise ValueError("the chat template does not render this conversation append-only")
        labels += [-100] * (len(before) - len(ids))
        turn = after[len(before) :]
        turn = turn[: turn.index(end_of_turn) + 1]
        ids, labels = before + turn, labels + turn
    return ids, labels


def warm_up(model, tokenizer, steps: int = 1000, tool_fraction: float = 0.5, seed: int = 0, lr: float = 3e-3) -> None:
    """Supervised format training: an example uses the calculator with ``tool_fraction``, else guesses a product."""
    rng = random.Random(seed)
    items = records()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = []
        for item in rng.choices(items, k=16):
            guess = None if rng.random() < tool_fraction else str(rng.choice(FACTORS) * rng.choice(FACTORS))
            batch.append(labelled(tokenizer, conversation(item["prompt"], guess)))
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        for i, (ids, lab) in enumerate(batch):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def save_warm_calc_model(out_dir: str | Path, seed: int = 0, steps: int = 1000) -> Path:
    """A tiny Qwen3-MoE with its tokenizer, warmed up on the calc task's tool format, as a HF directory. Its turns end
    at ``<|im_end|>``, which its config names as an end token beside the tokenizer's own (as Qwen's instruct models
    do), so engines stop there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = save_tiny_hf("Qwen3MoeForCausalLM", out_dir, seed=seed, **ALL_SPARSE)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    torch.manual_seed(seed)
    warm_up(model, tokenizer, steps=steps, seed=seed)
    model.config.eos_token_id = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id]
    model.save_pretrained(out)
    return out
