#!/usr/bin/env python3
"""Embedded engine (continuous batching) against a plain batched ``model.generate`` loop.

Both run the same transformers model on the same requests: prompts of 4-32 tokens and long-tailed
response lengths (log-normal, as RL rollouts are), sampled at temperature 1 with EOS ignored so each
request produces exactly its length. The ``generate`` loop takes the requests in fixed batches and
runs each batch until its longest request is done; the engine admits a new request the step another
one finishes. Throughput counts only the requested tokens (what a rollout keeps) per wall second.

    python bench/engine_throughput.py                      # tiny test model, 128 requests
    python bench/engine_throughput.py --hidden 256 --experts 32 --layers 8
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm


def make_requests(n: int, vocab: int, median_len: int, max_len: int, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(4, 33, size=n)
    lengths = np.clip(rng.lognormal(np.log(median_len), 0.9, size=n).astype(int), 1, max_len)
    return [
        (rng.integers(4, vocab, size=p).tolist(), int(length)) for p, length in zip(prompt_lens, lengths, strict=True)
    ]


def run_generate_loop(model, requests, batch_size: int, pad_id: int) -> float:
    start = time.perf_counter()
    for i in tqdm(range(0, len(requests), batch_size), desc="model.generate", leave=False):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        longest = max(length for _, length in batch)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def run_engine(model_dir: Path, requests, batch_size: int, routing_and_masks: bool) -> float:
    """Seconds for the embedded engine's scheduler to serve ``requests`` from ``model_dir`` (an FP8 checkpoint: served
    in FP8)."""
    from moerl.engines.embedded.engine import EmbeddedEngine
    from moerl.engines.embedded.scheduler import Request
    from moerl.engines.protocol import SamplingParams

    engine = EmbeddedEngine(str(model_dir), device="cpu", max_running=batch_size, prefix_cache_tokens=0)
    scheduler = engine.scheduler
    scheduler.start()
    done = threading.Semaphore(0)
    bar = tqdm(total=len(requests), desc="embedded engine", leave=False)

    def on_update(request, finished):
        if finished:
            bar.update()
            done.release()

    start = time.perf_counter()
    for i, (prompt, length) in enumerate(requests):
        scheduler.submit(
            Request(
                rid=str(i),
                input_ids=prompt,
                params=SamplingParams(max_new_tokens=length, ignore_eos=True),
                return_routed_experts=routing_and_masks,
                return_sampling_mask=routing_and_masks,
                on_update=on_update,
            )
        )
    for _ in requests:
        done.acquire()
    elapsed = time.perf_counter() - start
    bar.close()
    scheduler.stop()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="generate's batch size and the engine's max running requests"
    )
    parser.add_argument("--median-len", type=int, default=32, help="median response length")
    parser.add_argument("--max-len", type=int, default=384, help="longest response")
    parser.add_argument("--hidden", type=int, help="override the tiny model's hidden size")
    parser.add_argument("--layers", type=int, help="override the tiny model's layer count")
    parser.add_argument("--experts", type=int, help="override the tiny model's expert count")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from moerl.checkpoint.hf import save_fp8
    from moerl.models.tiny import save_tiny_hf

    overrides = {
        k: v
        for k, v in {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_experts": args.experts}.items()
        if v
    }
    if args.layers:
        overrides["mlp_only_layers"] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_hf("Qwen3MoeForCausalLM", Path(tmp) / "model", **overrides)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        requests = make_requests(args.requests, model.config.vocab_size, args.median_len, args.max_len, args.seed)
        tokens = sum(length for _, length in requests)
        warm = requests[: args.batch_size]
        run_generate_loop(model, warm, args.batch_size, model.config.pad_token_id)
        run_engine(model_dir, warm, args.batch_size, True)

        baseline = run_generate_loop(model, requests, args.batch_size, model.config.pad_token_id)
        plain = run_engine(model_dir, requests, args.batch_size, False)
        rl = run_engine(model_dir, requests, args.batch_size, True)
        # the same weights in FP8, emulated on the CPU (engines.quantization=fp8): slower here, never faster
        quantized = run_engine(save_fp8(model_dir, Path(tmp) / "fp8"), requests, args.batch_size, True)

    lengths = np.array([length for _, length in requests])
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Qwen3-MoE {params / 1e6:.2f}M params, hidden {model.config.hidden_size}, "
        f"{model.config.num_hidden_layers} layers, {model.config.num_experts} experts "
        f"top-{model.config.num_experts_per_tok}"
    )
    print(
        f"requests: {len(requests)}, response length median {int(np.median(lengths))}, p90 "
        f"{int(np.percentile(lengths, 90))}, max {lengths.max()}, {tokens} tokens; batch {args.batch_size}; "
        f"{args.threads} threads; {platform.processor() or platform.machine()}, torch {torch.__version__}"
    )
    print("| loop | seconds | tokens/s | ratio to model.generate |")
    print("| --- | --- | --- | --- |")
    for name, seconds in [
        ("model.generate, fixed batches", baseline),
        ("embedded engine", plain),
        ("embedded engine + routing + sampling masks", rl),
        ("the same, FP8 emulated (engines.quantization=fp8)", quantized),
    ]:
        print(f"| {name} | {seconds:.1f} | {tokens / seconds:.0f} | {baseline / seconds:.2f} |")


if __name__ == "__main__":
    main()
