#!/usr/bin/env python3
"""Trainer steps with each group's prompt fed once (``trainer.shared_prompt``) against the same groups unshared.

Groups of ``--group`` samples share a prompt; prompt and response lengths take the ratios 1:4, 1:1 and 4:1 of
``--tokens`` tokens a sample. One fp32 trainer rank (tiny Qwen3-MoE, R3 replay of random routing, the same for a
group's prompt), one warm-up step, then the median of ``--repeats`` steps, for padded, packed and shared
micro-batches under one token budget. Reported per shape and form: micro-batches per step, positions fed, seconds per
step, and the speed-up over padded. On the CPU packed and shared rows run megatron-core's local attention with an
explicit mask (each row costs its length squared); a shared prompt removes ``(G - 1) * P`` fed positions a group.

    python bench/shared_prompt.py [--groups 4] [--group 8] [--tokens 160] [--budget 1536] [--out FILE]
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((1, 4), (1, 1), (4, 1))  # prompt : response


def shared_prompt_batch(
    groups: int, group: int, prompt: int, response: int, vocab: int, moe_layers: int, experts: int, topk: int
) -> list:
    """``groups`` GRPO groups of ``group`` samples, each group's prompt (ids and routing) the same for its samples."""
    from moerl.sample import Sample

    rng = np.random.default_rng(0)

    def routed(n: int) -> np.ndarray:
        return np.argsort(rng.random((n, moe_layers, experts)), axis=-1)[..., :topk].astype(np.uint8)

    out = []
    for g in range(groups):
        prompt_ids, prompt_routing = rng.integers(0, vocab, prompt, dtype=np.int32), routed(prompt)
        for _ in range(group):
            out.append(
                Sample(
                    prompt_ids=prompt_ids,
                    response_ids=rng.integers(0, vocab, response, dtype=np.int32),
                    behaviour_logprobs=np.full(response, -5.0, np.float32),
                    versions=np.zeros(response, np.int64),
                    routing=np.concatenate([prompt_routing, routed(response - 1)]),
                    reward=float(rng.random()),
                    group_id=g,
                ).validate()
            )
    return out


def main() -> None:
    from bench.micro_batches import step_arguments, steps, tiny_moe_checkpoint
    from bench.report import publish

    from moerl.megatron.launch import run_ranks
    from moerl.trainer.config import ReplayConfig, TrainerConfig

    p = step_arguments(__doc__, budget=1536)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--tokens", type=int, default=160, help="prompt + response tokens of a sample")
    args = p.parse_args()

    forms = {
        "padded": {"micro_batch_format": "padded"},
        "packed": {"micro_batch_format": "packed"},
        "shared": {"micro_batch_format": "packed", "shared_prompt": True},
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-") as tmp:
        mcore, c, moe_layers = tiny_moe_checkpoint(Path(tmp))
        for prompt_part, response_part in SHAPES:
            prompt = args.tokens * prompt_part // (prompt_part + response_part)
            samples = shared_prompt_batch(
                args.groups,
                args.group,
                prompt,
                args.tokens - prompt,
                c["vocab_size"],
                moe_layers,
                c["num_experts"],
                c["num_experts_per_tok"],
            )
            results = {}
            for form, settings in forms.items():
                cfg = TrainerConfig(
                    micro_batch_tokens=args.budget, replay=ReplayConfig(routing="R3", sampling_mask=False), **settings
                )
                results[form] = run_ranks(steps, 1, mcore, cfg, samples, args.repeats)[0]
                print(f"{prompt_part}:{response_part}", form, results[form], flush=True)
            for form, r in results.items():
                rows.append(
                    f"| {prompt_part}:{response_part} ({prompt} + {args.tokens - prompt}) | {form} | "
                    f"{r['micro_batches']} | {r['fed']} | {r['seconds']:.2f} | "
                    f"{results['padded']['seconds'] / r['seconds']:.2f}x |"
                )
    lines = [
        f"\n## Shared prompts ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, one fp32 trainer "
        f"rank, tiny Qwen3-MoE, {args.groups} groups of {args.group}, {args.tokens} tokens a sample, budget "
        f"{args.budget} tokens, median of {args.repeats} steps)\n",
        "| prompt:response | form | micro-batches | positions fed | seconds per step | vs padded |",
        "| --- | --- | --- | --- | --- | --- |",
        *rows,
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
