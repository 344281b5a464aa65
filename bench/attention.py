#!/usr/bin/env python3
"""One attention layer's forward and backward over a GRPO group, three ways, on a GPU (the choice of kernel for
``trainer.shared_prompt``, issue 47 item 3):

- ``unshared``: the group's ``G`` samples whole, prompt and response each, causal (SDPA's flash kernel: a lower bound
  on what feeding every sample whole costs);
- ``dense``: the group packed as its prompt once then each response, through megatron-core's local attention with the
  explicit ``s x s`` mask (what the CPU path runs);
- ``flex``: the same packed row through FlexAttention's compiled block-sparse kernel (what the GPU path runs).

The layer is Qwen3-30B-A3B's on one tensor-parallel rank (32 query heads, 4 key-value groups, head size 128, bf16).
Reported per prompt:response shape: milliseconds per forward+backward (median of ``--repeats`` after warm-ups), peak
memory above the inputs (None for both: out of memory), and for ``flex`` the milliseconds to build its block mask.

    python bench/attention.py [--group 8] [--tokens 2560] [--repeats 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = ((1, 4), (1, 1), (4, 1))  # prompt : response


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2560, help="prompt + response tokens of a sample")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", type=Path, default=None, help="append one JSON line per shape and way")
    args = p.parse_args()
    sys.path.insert(0, str(REPO))
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from moerl.layout import Layout
    from moerl.megatron.attention import PackedSegments, SegmentAttention
    from moerl.megatron.parallel import init_distributed
    from moerl.megatron.segments import block_mask, dense_mask, segment_table

    if not torch.cuda.is_available():
        raise SystemExit("bench/attention.py times GPU kernels: no CUDA device is visible")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(Layout())
    heads, groups, dim = 32, 4, 128
    config = TransformerConfig(
        num_layers=1, hidden_size=2048, num_attention_heads=heads, num_query_groups=groups, kv_channels=dim,
        attention_dropout=0.0, params_dtype=torch.bfloat16, bf16=True,
    )  # fmt: skip
    attention = SegmentAttention(config, 1, AttnMaskType.causal, "self").cuda()
    device = torch.device("cuda")

    def timed(run) -> tuple[float | None, float | None]:
        """Median milliseconds and peak MiB of ``run``; None for both where it runs the GPU out of memory."""
        try:
            return measured(run)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            return None, None

    def measured(run) -> tuple[float, float]:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20

    def inputs(s: int, batch: int):
        return [
            torch.randn(s, batch, n, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
            for n in (heads, groups, groups)
        ]

    for prompt_part, response_part in SHAPES:
        prompt = args.tokens * prompt_part // (prompt_part + response_part)
        response = args.tokens - prompt
        shape = f"{prompt_part}:{response_part}"
        rows = []

        q, k, v = (t.transpose(0, 1).transpose(1, 2) for t in inputs(args.tokens, args.group))  # [b, h, s, d]

        def unshared(q=q, k=k, v=v):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()

        rows.append(("unshared", args.group * args.tokens, *timed(unshared), None))

        lengths = [prompt] + [response] * args.group
        segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        exits = torch.tensor([1 + args.group] + [2 + k for k in range(args.group)])  # the prompt's subtree: all
        table = segment_table(segments, exits[segments]).to(device)
        s = prompt + args.group * response
        packed = inputs(s, 1)
        for way, mask, params in (("dense", dense_mask(table), None), ("flex", None, PackedSegments(table))):

            def shared(mask=mask, params=params, packed=packed):
                attention(*packed, mask, attn_mask_type=AttnMaskType.causal, packed_seq_params=params).sum().backward()

            build = None
            if way == "flex":
                block_mask(table)  # compiled once
                torch.cuda.synchronize()
                start = time.perf_counter()
                block_mask(table)
                torch.cuda.synchronize()
                build = 1e3 * (time.perf_counter() - start)
            rows.append((way, s, *timed(shared), build))
        for way, fed, ms, mib, build in rows:
            line = {
                "device": torch.cuda.get_device_name(),
                "shape": shape,
                "group": args.group,
                "way": way,
                "positions": fed,
                "ms_fwd_bwd": None if ms is None else round(ms, 3),  # None: out of memory
                "peak_mib": None if mib is None else round(mib, 1),
                "mask_build_ms": None if build is None else round(build, 3),
            }
            print(json.dumps(line))
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
