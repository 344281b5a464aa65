"""``moerl tiny-model``: write a tiny random Qwen MoE model (:mod:`moerl.models.tiny`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from moerl.models.tiny import ARCHITECTURES, save_tiny_hf


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moerl tiny-model",
        description="Write a tiny random Qwen MoE model (transformers' own classes) with a char-level tokenizer "
        "as a HF directory, for demos and tests where no model can be downloaded.",
    )
    parser.add_argument("--arch", choices=ARCHITECTURES, default=ARCHITECTURES[0], help="model family")
    parser.add_argument("--out", required=True, help="new directory to write")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    if Path(args.out).exists():
        parser.error(f"output directory {args.out} already exists; choose a new one")
    print(f"wrote tiny {args.arch} to {save_tiny_hf(args.arch, args.out, seed=args.seed)}")
    return 0
