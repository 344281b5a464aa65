#!/usr/bin/env python3
"""The data plane per rank: what weight sync and batch distribution make each trainer rank take in.

Weight sync: a generated Qwen3-MoE (32 experts, hidden 1024, fp32 as trained here) is exported at each layout
and pushed by ``BroadcastSync`` (gloo, 64 MiB buckets) to one embedded engine, as after every step of the main
job. Per layout: the sync's seconds (median of the repeats), the bytes each rank's collectives took in, and each
rank's peak RSS growth during the syncs; beside it, the transport's own limit: one process pushing the same
tensors, already in memory, to the same engine.

Batch distribution: a fixed global batch of long-tailed samples with routing (and kept sets) is handed out by
``BatchDistributor`` at each layout. Per rank: bytes received, against its own shard's bytes (the arrays its
stage reads) and against what the whole-batch broadcast it replaced sent every rank (the pickled batch).

On paper: Qwen3-30B-A3B (its config.json, bf16) on 2 nodes x 8 H100 at the recipe's TP2xEP8, from the same
byte counts.

    python bench/data_plane.py --work /tmp/dataplane [--out docs/benchmarks/data-plane.md]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from convert_memory import generate  # noqa: E402
from micro_batches import long_tailed_batch  # noqa: E402
from moerl.layout import Layout  # noqa: E402
from report import publish  # noqa: E402

LAYOUTS = {
    "world 1": (1, Layout()),
    "EP2": (2, Layout(ep=2)),
    "EP4": (4, Layout(ep=4)),
    "TP2xEP2": (4, Layout(tp=2, ep=2)),
}
# several senders: per stage, per EP rank
SYNC_LAYOUTS = {**LAYOUTS, "PP2": (2, Layout(pp=2)), "EP2xPP2": (4, Layout(ep=2, pp=2))}
BUCKET = 64 << 20


class PeakRSS:
    """Samples this process's RSS every 10 ms while open; ``growth`` is the peak above the RSS at entry."""

    def __enter__(self):
        self.proc = psutil.Process()
        self.start = self.peak = self.proc.memory_info().rss
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.done.wait(0.01):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc):
        self.done.set()
        self.thread.join()
        self.growth = self.peak - self.start


def sync_worker(mcore_dir: str, layout: Layout, url: str, repeats: int) -> dict:
    """One trainer rank: export and push the weights ``repeats`` times (rank 0 talks to the engine)."""
    import torch.distributed as dist

    from moerl.checkpoint.mcore import load_megatron_model
    from moerl.weight_sync.broadcast import BroadcastSync

    cfg, model = load_megatron_model(mcore_dir, layout)
    rank0 = dist.get_rank() == 0
    sync = BroadcastSync(
        [url] if rank0 else None, "127.0.0.1", "gloo", group_name=f"bench-{layout}", bucket_bytes=BUCKET
    )
    sync.connect()
    seconds, received = [], []
    with PeakRSS() as rss:
        for i in range(repeats):
            if sync.gather is not None:
                sync.gather.received = 0
            dist.barrier()
            start = time.perf_counter()
            sync.push_model(model, cfg, f"{layout}-{i}")
            dist.barrier()
            seconds.append(time.perf_counter() - start)
            received.append(sync.gather.received)
    sync.close()
    return {
        "seconds": statistics.median(seconds),
        "received": max(received),
        "rss_growth": rss.growth,
        "sends": sync.sender is not None,
    }


def raw_push(model: Path, url: str, repeats: int) -> float:
    """The transport's limit: the same Hub tensors, already in memory, pushed from one process."""
    from safetensors.torch import load_file

    from moerl.weight_sync.broadcast import BroadcastSync

    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update({k: v.float() for k, v in load_file(f).items()})
    sync = BroadcastSync([url], "127.0.0.1", "gloo", group_name="bench-raw", bucket_bytes=BUCKET)
    sync.connect()
    try:
        return statistics.median(sync.push(sorted(weights.items()), f"raw{i}").seconds for i in range(repeats))
    finally:
        sync.close()


def weight_sync(work: Path, repeats: int) -> tuple[list[str], int]:
    from moerl.megatron.launch import run_ranks
    from tests.engine_server import running_server

    hf, mcore = work / "hf", work / "mcore"
    if not (hf / "config.json").exists():
        generate(hf, layers=2, experts=32, shard_gb=1.0)
    if not mcore.exists():
        subprocess.run(
            [sys.executable, "-m", "moerl.cli", "convert-ckpt", "hf-to-mcore", "--hf", str(hf), "--out", str(mcore)],
            check=True,
            cwd=REPO,
        )
    from moerl.checkpoint.hf import read_config
    from moerl.models import family_for

    raw = read_config(hf)
    family = family_for(raw)
    model_bytes = family.hub_numel(family.normalize(raw)) * 4  # fp32, as the trainer here holds it
    results = {}
    with running_server(hf, work / "engine-logs") as url:
        raw_s = raw_push(hf, url, repeats)
        for name, (world, layout) in SYNC_LAYOUTS.items():
            results[name] = run_ranks(sync_worker, world, str(mcore), layout, url, repeats)
    base = results["world 1"][0]["seconds"]
    lines = [
        "## Weight sync per rank (x86_64, 2 cores; generated Qwen3-MoE, 32 experts, 2 layers, "
        f"{model_bytes / 2**20:.0f} MiB in fp32; one embedded engine over gloo; {BUCKET >> 20} MiB buckets; median of "
        f"{repeats})",
        "",
        "| layout | ranks | senders | sync s | vs world 1 | vs raw push | taken in, rank 0 (x model) | most taken in "
        "by another rank (x model) | peak RSS growth per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ranks in results.items():
        others = max((r["received"] for r in ranks[1:]), default=0)
        growth = " / ".join(f"{r['rss_growth'] / 2**20:.0f}" for r in ranks)
        lines.append(
            f"| {name} | {len(ranks)} | {sum(r['sends'] for r in ranks)} | {ranks[0]['seconds']:.2f} | "
            f"{ranks[0]['seconds'] / base:.2f}x | {ranks[0]['seconds'] / raw_s:.2f}x | "
            f"{ranks[0]['received'] / model_bytes:.2f} | {others / model_bytes:.2f} | {growth} |"
        )
    lines += [
        "",
        f"Raw push of the same {model_bytes / 2**20:.0f} MiB from one process (tensors in memory): {raw_s:.2f} s.",
        "",
    ]
    return lines, model_bytes


def distribute_worker(layout: Layout, samples: list, moe_layers: int) -> dict:
    """One trainer rank: its part of the batch, as the trainer receives it (each pipeline stage's routers are its
    own MoE layers, an even split here)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moerl.megatron.parallel import init_distributed
    from moerl.trainer.config import ReplayConfig, TrainerConfig
    from moerl.trainer.distribute import BatchDistributor

    init_distributed(layout)
    per = moe_layers // layout.pp
    stage = parallel_state.get_pipeline_model_parallel_rank()
    columns = list(range(stage * per, (stage + 1) * per))
    distributor = BatchDistributor(TrainerConfig(replay=ReplayConfig(routing="R3", sampling_mask=True)), columns)
    with PeakRSS() as rss:
        instalment = distributor.scatter(samples if dist.get_rank() == 0 else None)
    needs = distributor.needs
    own = sum(
        s.routing.nbytes
        + (4 * (s.prompt_len + s.response_len) if needs.ids else 0)
        + (s.response_len * (4 + 8 + 4) + 4 * len(s.mask_ids) if needs.last else 0)
        for s in instalment.samples
    )
    return {"received": instalment.received, "own": own, "rss_growth": rss.growth}


def with_kept_sets(samples: list, rng: np.random.Generator, vocab: int) -> list:
    """Give each response token a kept set (top-k 20 sampling: the token and up to 19 others)."""
    for s in samples:
        counts = rng.integers(1, 21, s.response_len)
        s.mask_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        s.mask_ids = rng.integers(0, vocab, int(counts.sum()), dtype=np.int32)
        s.mask_ids[s.mask_offsets[:-1]] = s.response_ids
        s.selected_logprobs = s.behaviour_logprobs.copy()
    return samples


def distribution(samples_n: int) -> list[str]:
    from moerl.megatron.launch import run_ranks

    moe_layers, topk, vocab = 8, 8, 32768
    rng = np.random.default_rng(0)
    samples = with_kept_sets(long_tailed_batch(samples_n, 8, vocab, moe_layers, 64, topk, 4096), rng, vocab)
    pickled = len(pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL))
    tokens = sum(s.prompt_len + s.response_len for s in samples)
    lines = [
        f"## Batch distribution per rank ({samples_n} long-tailed samples, {tokens} tokens, routing of {moe_layers} "
        f"MoE layers x top-{topk}, kept sets; the batch pickled: {pickled / 2**20:.1f} MiB, what the whole-batch "
        "broadcast sent every rank)",
        "",
        "| layout | ranks | received per rank (MiB) | received / own shard | received / whole-batch broadcast | peak "
        "RSS growth (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (world, layout) in {**LAYOUTS, "PP2xDP2": (4, Layout(pp=2, ep=2))}.items():
        ranks = run_ranks(distribute_worker, world, layout, samples, moe_layers)
        others = ranks[1:] or ranks
        received = " / ".join(f"{r['received'] / 2**20:.2f}" for r in ranks)
        growth = " / ".join(f"{r['rss_growth'] / 2**20:.0f}" for r in ranks)
        lines.append(
            f"| {name} | {world} | {received} | {max(r['received'] / r['own'] for r in others):.3f} | "
            f"{max(r['received'] for r in others) / pickled:.3f} | {growth} |"
        )
    lines += [
        "",
        'Rank 0 holds the batch and receives nothing; "received / own shard" is the worst other rank\'s bytes over the '
        "arrays its stage reads of its own samples (the rest is the plan: six numbers per sample of the instalment).",
        "",
    ]
    return lines


def on_paper() -> list[str]:
    """Qwen3-30B-A3B, bf16, 16 trainer ranks at TP2xEP8 (2 nodes x 8 H100): bytes each rank takes in per sync and per
    step."""
    from moerl.models import family_for

    raw = json.loads((REPO / "tests" / "data" / "qwen3_30b_a3b" / "config.json").read_text())
    family = family_for(raw)
    cfg = family.normalize(raw)
    expert = (
        sum(
            np.prod(s)
            for rule in family.all_rules(cfg)
            if ".experts.local_experts." in rule.mcore
            for s in rule.hf_shapes
        )
        * 2
    )
    total = family.hub_numel(cfg) * 2
    dense = total - expert
    world, tp, ep = 16, 2, 8
    # What rank 0 takes in: the other TP half of every TP-sharded dense tensor (about all of them). Experts (ETP1) are
    # not gathered: each EP rank sends its own.
    rank0 = dense * (tp - 1) / tp
    # The gather it replaced: every rank received every rank's pickled TP-gathered tensors.
    old = (world - 1) * dense + expert * world / ep - expert / ep
    routing = 512 * 32768 * 48 * 8  # 512 samples x 32K tokens x 48 MoE layers x top-8, one byte per expert id
    shard = routing / (world // tp)  # a data-parallel replica's routing
    nvlink, ib = 450e9, 50e9  # bytes/s: H100 NVLink per direction; 400 Gb/s InfiniBand
    g = 1e9
    return [
        "## On paper: Qwen3-30B-A3B (bf16) on 2 nodes x 8 H100, TP2xEP8 (the recipe's 16 ranks), 512 x 32K-token "
        "samples per step",
        "",
        "| what | before (world-wide object gathers / broadcasts) | now | seconds now |",
        "|---|---|---|---|",
        f"| model (Hub bytes) | {total / g:.1f} GB | | |",
        f"| sync: taken in by rank 0 | {old / g:.0f} GB, pickled | {rank0 / g:.1f} GB (its TP peer's halves, NVLink) | "
        f"{rank0 / nvlink:.3f} s at NVLink |",
        f"| sync: taken in by any other rank | {old / g:.0f} GB, pickled | 0 | 0 |",
        f"| sync: sent to the engines by rank 0 | {total / g:.1f} GB | {(dense + expert / ep) / g:.1f} GB (dense + its "
        f"experts) | {(dense + expert / ep) / ib:.2f} s at 400 Gb/s IB (its NIC) |",
        f"| sync: sent by each other EP rank's sender (7) | 0 | {expert / ep / g:.1f} GB (its experts) | "
        f"{expert / ep / ib:.2f} s (its NIC) |",
        f"| sync: taken in by each engine GPU | {total / g:.1f} GB | {total / g:.1f} GB | {total / ib:.2f} s at 400 "
        "Gb/s IB |",
        f"| step: routing taken in per rank | {routing / g:.1f} GB, pickled | {shard / g:.2f} GB (its replica's shard) "
        f"| {shard / ib:.3f} s at 400 Gb/s IB |",
        f"| step: routing sent by rank 0 | {routing * (world - 1) / g:.0f} GB | {shard * (world // tp - 1) / g:.1f} GB "
        f"(each other replica's shard once, to its TP group's first rank) | {shard * (world // tp - 1) / ib:.2f} s at "
        "400 Gb/s IB |",
        "",
        "Peers, as published: verl checkpoint-engine 4.4 s, miles 2.7 s (NCCL) / 2.2 s (RDMA) on 2 H100 nodes, NeMo-RL "
        "reshard 0.74-1.0 s on H100. With a sender per EP rank no trainer link carries more than the dense weights and "
        "an eighth of the experts; the bound moves to the engines, whose every GPU takes in the whole model (SGLang "
        "broadcasts each bucket to all of a replica's ranks, and its scheduler takes one group's update at a time).",
        "",
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/moerl-dataplane", help="where the generated model and its conversion go")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--samples", type=int, default=256, help="samples in the distributed batch")
    p.add_argument("--out", help="append the tables to this markdown file")
    args = p.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    publish(["## Data plane per rank (`bench/data_plane.py`)", ""] + on_paper(), args.out)
    publish(distribution(args.samples), args.out)
    publish(weight_sync(work, args.repeats)[0], args.out)


if __name__ == "__main__":
    torch.multiprocessing.set_start_method("spawn", force=True)
    main()
