#!/usr/bin/env python3
"""Peak memory of ``tools/convert_ckpt.py`` on a generated Qwen3-MoE checkpoint of a few GB.

Writes a random bf16 Qwen3-MoE HF directory (sharded safetensors with an index, Hub names) tensor
by tensor, converts it hf-to-mcore and back with the real CLI in child processes, samples each
child's memory, checks the round trip is bitwise, and prints a Markdown table row per direction.
"RSS" is the converter process's resident set, including the safetensors pages it has mapped and
read; "PSS" sums the proportional set size over it and the helper processes megatron-core's
checkpoint writer starts (shared pages split between them, so nothing is counted twice).

    python bench/convert_memory.py --work /tmp/convbench        # ~2.6 GB model, ~8 GB of disk
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]


def generate(out: Path, layers: int, experts: int, shard_gb: float) -> dict:
    from transformers import Qwen3MoeConfig

    from moerl.checkpoint.hf import HFWriter
    from moerl.models import family_for

    config = Qwen3MoeConfig(
        vocab_size=32768,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        moe_intermediate_size=512,
        num_experts=experts,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = "bfloat16"
    out.mkdir(parents=True)
    config.to_json_file(out / "config.json")
    raw = config.to_dict()
    family = family_for(raw)
    cfg = family.normalize(raw)
    writer = HFWriter(out, int(shard_gb * 1024**3))
    generator = torch.Generator().manual_seed(0)
    for rule in tqdm(family.all_rules(cfg), desc="generate", unit="tensor"):
        for name, shape in zip(rule.hf, rule.hf_shapes, strict=True):
            writer.add(name, (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16))
    writer.close()
    return {"bytes": writer.total_bytes, "shards": len(list(out.glob("*.safetensors")))}


def peak_memory(cmd: list[str]) -> dict:
    """Run ``cmd``; sample its RSS and the PSS of it and its children every 50 ms."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    main = psutil.Process(proc.pid)
    peak_rss = peak_pss = 0
    while proc.poll() is None:
        try:
            rss = main.memory_info().rss
            pss = sum(p.memory_full_info().pss for p in [main, *main.children(recursive=True)])
        except psutil.NoSuchProcess:
            continue
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss)
        time.sleep(0.05)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return {"peak_rss": peak_rss, "peak_pss": peak_pss, "seconds": time.perf_counter() - start}


def bitwise_equal(a: Path, b: Path) -> bool:
    from moerl.checkpoint.hf import HFReader

    ra, rb = HFReader(a), HFReader(b)
    return ra.names() == rb.names() and all(
        torch.equal(ra.get(n), rb.get(n)) for n in tqdm(sorted(ra.names()), desc="compare")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch directory (must not exist)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--shard-gb", type=float, default=0.5, help="HF shard size of the generated model")
    parser.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = parser.parse_args()
    if args.work.exists():
        parser.error(f"--work {args.work} exists; give a new directory")
    hf, mcore, back = args.work / "hf", args.work / "mcore", args.work / "back"
    try:
        model = generate(hf, args.layers, args.experts, args.shard_gb)
        tool = [sys.executable, str(REPO / "tools/convert_ckpt.py")]
        runs = {
            "hf-to-mcore": peak_memory([*tool, "hf-to-mcore", "--hf", str(hf), "--out", str(mcore), "--no-progress"]),
            "mcore-to-hf": peak_memory(
                [
                    *tool,
                    "mcore-to-hf",
                    "--mcore",
                    str(mcore),
                    "--out",
                    str(back),
                    "--max-shard-gb",
                    str(args.shard_gb),
                    "--no-progress",
                ]
            ),
        }
        exact = bitwise_equal(hf, back)
        gib = 1024**3
        print(json.dumps({"model": model, "runs": runs, "bitwise_round_trip": exact}))
        print("| direction | model | largest layer | peak RSS | peak PSS (with helpers) | time | round trip |")
        layer_bytes = args.experts * 3 * 1024 * 512 * 2
        for name, r in runs.items():
            print(
                f"| {name} | {model['bytes'] / gib:.2f} GiB in {model['shards']} shards of {args.shard_gb} GiB "
                f"| {layer_bytes / gib:.2f} GiB | {r['peak_rss'] / gib:.2f} GiB | {r['peak_pss'] / gib:.2f} GiB "
                f"| {r['seconds']:.0f} s | {'bitwise' if exact else 'DIFFERS'} |"
            )
        if not exact:
            raise SystemExit("round trip is not bitwise identical")
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
