#!/usr/bin/env python3
r"""Routing replay ablation: the train-inference mismatch of a bf16 engine against an fp32 trainer, decomposed by
routing, under replay off / R2 / R3, with and without the sampling-mask replay.

Two models: one generated so that routing is fragile (``--experts`` experts, top ``--topk``, ``--layers`` MoE layers,
router weights scaled by ``--router-scale`` so the logits are near-tied and bf16 rounding flips experts), and the CPU
demo's (the warmed-up tiny model). Rollouts: the embedded engine in bf16 on the tiny task's prompts; each
configuration: one trainer step (fp32, one rank) on the same samples, whose old-policy pass measures the mismatch
(``mismatch/*``: the trainer's log-probs against the engine's) on the tokens whose positions the trainer routes
natively as the engine did in every MoE layer (agree) and on the rest (differ).

    python bench/replay_ablation.py [--prompts 16 --samples 4 --max-new-tokens 48] \
        [--out docs/benchmarks/routing-replay.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from report import publish  # noqa: E402

GRID = [(routing, mask) for routing in ("off", "R2", "R3") for mask in (False, True)]


def fragile_model(out: Path, experts: int, topk: int, layers: int, router_scale: float) -> Path:
    """A generated Qwen3-MoE whose routers' logits are near-tied: its gate weights scaled by ``router_scale``."""
    import torch

    from moerl.models.tiny import tiny_hf_model, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = tiny_hf_model(
        "Qwen3MoeForCausalLM",
        num_hidden_layers=layers,
        num_experts=experts,
        num_experts_per_tok=topk,
        mlp_only_layers=[],
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(router_scale)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def rollouts(hf_dir: Path, prompts: int, samples: int, max_new_tokens: int) -> list:
    """The bf16 embedded engine's samples of the tiny task's first ``prompts`` prompts, with routing and kept sets."""
    import torch
    from transformers import AutoTokenizer

    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.protocol import decode_generate
    from moerl.models import model_shape
    from moerl.sample import Sample
    from moerl.tasks import PromptStream, TaskConfig

    stream = PromptStream(TaskConfig(name="tiny"), AutoTokenizer.from_pretrained(hf_dir))
    shape = model_shape(json.loads((hf_dir / "config.json").read_text()))
    engine = EmbeddedEngine(str(hf_dir), dtype=torch.bfloat16, device="cpu")
    engine.scheduler.start()
    out = []
    try:
        for group in range(prompts):
            _, ids = stream.get(group)
            body = {
                "input_ids": ids,
                "return_logprob": True,
                "return_routed_experts": True,
                "return_sampling_mask": True,
                "sampling_params": {
                    "n": samples,
                    "max_new_tokens": max_new_tokens,
                    "top_k": 16,
                    "sampling_seed": group,
                },
            }
            for response in engine.generate(body):
                out.append(
                    Sample.from_completion(
                        decode_generate(response, shape),
                        ids,
                        temperature=1.0,
                        reward=float(group % 2),
                        group_id=group,
                        versions={"default": 0},
                    )
                )
    finally:
        engine.scheduler.stop()
    return out


def step_metrics(mcore_dir: str, cfg, samples: list) -> dict:
    from moerl.trainer.trainer import Trainer

    return Trainer(mcore_dir, cfg).step(samples)


def table(name: str, hf_dir: Path, root: Path, args) -> list[str]:
    """The grid's rows for the model at ``hf_dir``."""
    from moerl.checkpoint.convert import hf_to_mcore
    from moerl.megatron.launch import run_ranks
    from moerl.trainer.config import ReplayConfig, TrainerConfig

    samples = rollouts(hf_dir, args.prompts, args.samples, args.max_new_tokens)
    mcore = hf_to_mcore(hf_dir, hf_dir.with_name(hf_dir.name + "-mcore"), progress=False)
    tokens = sum(s.response_len for s in samples)
    lines = [
        f"## {name}: bf16 engine, fp32 trainer, {len(samples)} samples, {tokens} response tokens",
        "",
        "| routing replay | sampling mask replay | routing agreement | tokens differing in a layer | k3 all | k3 agree "
        "| k3 differ | differ / agree | mean abs delta all |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for routing, mask in GRID:
        cfg = TrainerConfig(
            micro_batch_tokens=4096, dtype="float32", replay=ReplayConfig(routing=routing, sampling_mask=mask)
        )
        m = run_ranks(step_metrics, 1, str(mcore), cfg, samples)[0]
        agree, differ = m["mismatch/k3_kl_routing_agree"], m["mismatch/k3_kl_routing_differ"]
        lines.append(
            f"| {routing} | {'on' if mask else 'off'} | {m['routing/agreement']:.4f} | "
            f"{m['routing/differs_any_layer']:.3f} | {m['mismatch/k3_kl']:.3e} | {agree:.3e} | {differ:.3e} | "
            f"{differ / agree:.2f} | {m['mismatch/abs_logprob_delta']:.3e} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument(
        "--router-scale",
        type=float,
        default=0.05,
        help="the generated model's gate weights times this: near-tied logits",
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--out")
    args = p.parse_args()
    from moerl.tasks.tiny import save_warm_tiny_model

    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; prompts of the tiny task, top-k 16, temperature 1.",
        "",
    ]
    with tempfile.TemporaryDirectory(prefix="moerl-replay-") as tmp:
        root = Path(tmp)
        fragile = fragile_model(root / "fragile", args.experts, args.topk, args.layers, args.router_scale)
        lines += table(
            f"Generated, fragile routing ({args.experts} experts, top-{args.topk}, {args.layers} MoE layers, router "
            f"x{args.router_scale:g})",
            fragile,
            root,
            args,
        ) + [""]
        lines += table(
            "The CPU demo's model (warmed-up tiny Qwen3-MoE, 8 experts, top-2, 3 MoE layers)",
            save_warm_tiny_model(root / "demo"),
            root,
            args,
        )
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
