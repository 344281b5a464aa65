#!/usr/bin/env python3
"""Trainer steps on padded against packed micro-batches, same batch, same token budget.

A batch of GRPO groups with long-tailed response lengths (log-normal, capped), as RL rollouts have:
padded micro-batches pay for every row up to its longest sample, packed ones lay samples end to end.
One trainer rank (R3 routing replay of random rollout routing, full-vocabulary log-probs), one
warm-up step, then the median seconds of ``--repeats`` steps. Reported per form: micro-batches per
step, the share of fed positions that are padding, seconds per step, trained tokens per second.

    python bench/micro_batches.py [--samples 64] [--budget 2048] [--out docs/benchmarks/micro-batches.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def long_tailed_batch(
    samples: int, group: int, vocab: int, moe_layers: int, experts: int, topk: int, cap: int, seed: int = 0
) -> list:
    from moerl.sample import Sample

    rng = np.random.default_rng(seed)
    out = []
    for i in range(samples):
        prompt, response = int(rng.integers(16, 48)), int(min(cap, max(4, rng.lognormal(4.5, 0.8))))
        fed = prompt + response - 1
        routing = np.argsort(rng.random((fed, moe_layers, experts)), axis=-1)[..., :topk].astype(np.uint8)
        out.append(
            Sample(
                prompt_ids=rng.integers(0, vocab, prompt, dtype=np.int32),
                response_ids=rng.integers(0, vocab, response, dtype=np.int32),
                behaviour_logprobs=np.full(response, -5.0, np.float32),
                versions=np.zeros(response, np.int64),
                routing=routing,
                reward=float(rng.random()),
                group_id=i // group,
            ).validate()
        )
    return out


def steps(mcore_dir: str, cfg, samples: list, repeats: int) -> dict:
    """Runs on a trainer rank: the form's micro-batch shapes, then timed steps."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, cfg)
    batches = trainer.micro_batches(trainer.batches.scatter(samples))
    fed = sum(int(mb.real_positions().sum()) for mb in batches)  # a shared prompt counted once
    positions = sum(mb.input_ids.numel() for mb in batches)
    trainer.step(samples)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        metrics = trainer.step(samples)
        times.append(time.perf_counter() - start)
    return {
        "micro_batches": len(batches),
        "padding": 1 - fed / positions,
        "seconds": statistics.median(times),
        "tokens": metrics["train/tokens"],
        "fed": fed,
    }


def step_arguments(doc: str | None, budget: int) -> argparse.ArgumentParser:
    """The options every trainer-step benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=8, help="samples per GRPO group")
    p.add_argument("--budget", type=int, default=budget, help="micro_batch_tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="append the table to this markdown file")
    return p


def tiny_moe_checkpoint(directory: Path) -> tuple[str, dict, int]:
    """A tiny random Qwen3-MoE converted to a Megatron checkpoint in ``directory``: (its path, the model's normalised
    config, its MoE layers)."""
    from moerl.checkpoint.convert import hf_to_mcore
    from moerl.models import family_for
    from moerl.models.tiny import save_tiny_hf

    hf = save_tiny_hf("Qwen3MoeForCausalLM", directory / "hf")
    mcore = hf_to_mcore(hf, directory / "mcore", progress=False)
    raw = json.loads((hf / "config.json").read_text())
    c = family_for(raw).normalize(raw)
    return str(mcore), c, sum(family_for(c).moe_layer_pattern(c))


def main() -> None:
    p = step_arguments(__doc__, budget=2048)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--cap", type=int, default=512, help="longest response")
    args = p.parse_args()
    from bench.report import publish

    from moerl.megatron.launch import run_ranks
    from moerl.trainer.config import ReplayConfig, TrainerConfig

    results = {}
    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        mcore, c, moe_layers = tiny_moe_checkpoint(Path(tmp))
        samples = long_tailed_batch(
            args.samples, args.group, c["vocab_size"], moe_layers, c["num_experts"], c["num_experts_per_tok"], args.cap
        )
        for form in ("padded", "packed"):
            cfg = TrainerConfig(
                micro_batch_tokens=args.budget,
                micro_batch_format=form,
                replay=ReplayConfig(routing="R3", sampling_mask=False),
            )
            results[form] = run_ranks(steps, 1, mcore, cfg, samples, args.repeats)[0]
            print(form, results[form], flush=True)
    lengths = [s.response_len for s in samples]
    base = results["padded"]
    lines = [
        f"\n## Padded vs packed micro-batches ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"one fp32 trainer rank, tiny Qwen3-MoE, {args.samples} samples, responses mean {np.mean(lengths):.0f} / max "
        f"{max(lengths)} tokens, budget {args.budget} tokens, median of {args.repeats} steps)\n",
        "| form | micro-batches | padding share of fed positions | seconds per step | trained tokens/s | vs padded |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for form, r in results.items():
        lines.append(
            f"| {form} | {r['micro_batches']} | {r['padding']:.2f} | {r['seconds']:.2f} | "
            f"{r['tokens'] / r['seconds']:.0f} | {base['seconds'] / r['seconds']:.2f}x |"
        )
    publish(lines, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
