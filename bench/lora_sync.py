"""Adapter-only against full-weight sync: bytes moved and seconds per update.

For each model, one embedded engine serves it and one process pushes to it what the main job pushes
after a step: every Hub-named weight through ``BroadcastSync`` (gloo, 512 MiB flattened buckets), or
the per-expert LoRA adapters of every linear layer (rank 8, the default targets) through
``AdapterSync`` (adapter tensors over HTTP, and an adapter directory + /load_lora_adapter). The adapters are
random tensors of the exact shapes the trainer exports; gathering them across ranks is not timed
(the full-weight path gathers too). Bytes are also computed, without tensors, for Qwen3-30B-A3B's
shape (128 experts, top-8, 48 layers).

Usage: python bench/lora_sync.py [--out docs/benchmarks/lora-sync.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import torch

from moerl.checkpoint.peft import export_adapter
from moerl.megatron.lora_config import LoRAConfig
from moerl.models import family_for

LORA = LoRAConfig(enabled=True, rank=8)
QWEN3_30B_A3B = {  # config.json of Qwen/Qwen3-30B-A3B, the keys the mapping reads
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


def adapter_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Full megatron names and shapes of the adapters the trainer would export for ``hf_config``."""
    family = family_for(hf_config)
    cfg = family.normalize(hf_config)
    shapes = {}
    for rule in family.all_rules(cfg):
        module = rule.mcore.removesuffix(".weight")
        if not LORA.targets_module(module):
            continue
        out_features, in_features = sum(s[0] for s in rule.hf_shapes), rule.hf_shapes[0][1]
        shapes[f"{module}.lora_A"], shapes[f"{module}.lora_B"] = (LORA.rank, in_features), (out_features, LORA.rank)
    return shapes


def byte_counts(hf_config: dict, element: int) -> tuple[int, int]:
    """(full-weight bytes, adapter bytes as pushed: PEFT tensors, A repeated per fused part)."""
    family = family_for(hf_config)
    cfg = family.normalize(hf_config)
    full = family.hub_numel(cfg)
    rules = {rule.mcore.removesuffix(".weight"): rule for rule in family.all_rules(cfg)}
    adapter = 0
    for name, shape in adapter_shapes(hf_config).items():
        module, factor = name.rsplit(".", 1)
        adapter += math.prod(shape) * (len(rules[module].hf) if factor == "lora_A" else 1)
    return full * element, adapter * element


def timings(work: Path, model: Path, repeats: int) -> dict[str, float]:
    import json

    from safetensors.torch import load_file

    from moerl.weight_sync.broadcast import BroadcastSync
    from moerl.weight_sync.lora import AdapterSync
    from tests.engine_server import running_server

    hf_config = json.loads((model / "config.json").read_text())
    weights = {}
    for f in sorted(model.glob("*.safetensors")):
        weights.update(load_file(f))
    generator = torch.Generator().manual_seed(0)
    lora = {n: torch.randn(s, generator=generator) * 1e-3 for n, s in adapter_shapes(hf_config).items()}
    out = {}
    with running_server(model, work / f"{model.name}-engine-logs") as url:
        full = BroadcastSync([url], "127.0.0.1", "gloo", group_name=f"bench-{model.name}", bucket_bytes=512 << 20)
        full.connect()
        tensor_sync = AdapterSync([url], LORA, hf_config, str(model))
        disk_sync = AdapterSync([url], LORA, hf_config, str(model), directory=work / f"{model.name}-adapters")
        disk_sync.connect()
        try:
            runs = {"full_s": [], "adapter_tensors_s": [], "adapter_disk_s": []}
            for i in range(repeats):
                runs["full_s"].append(full.push(sorted(weights.items()), version=f"full{i}").seconds)
                for key, sync, version in (
                    ("adapter_tensors_s", tensor_sync, 2 * i),
                    ("adapter_disk_s", disk_sync, 2 * i + 1),
                ):
                    runs[key].append(sync.push(lora, version).seconds)
                    sync.link.run(sync.link.client.unload_lora(f"moerl-lora-v{version}"))
            out = {k: statistics.median(v) for k, v in runs.items()}
        finally:
            for sync in (full, tensor_sync, disk_sync):
                sync.close()
    family = family_for(hf_config)
    tensors = export_adapter(family, family.normalize(hf_config), lora, LORA, "sglang", str(model)).tensors
    out["adapter_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    out["full_bytes"] = sum(t.numel() * t.element_size() for t in weights.values())
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="append the tables to this markdown file")
    args = p.parse_args()
    from bench.report import publish

    from moerl.models.tiny import save_tiny_hf

    rows = []
    with tempfile.TemporaryDirectory(prefix="moerl-bench-lora-") as tmp:
        work = Path(tmp)
        models = {
            "tiny Qwen3-MoE (8 experts, top-2, hidden 64, 4 layers)": save_tiny_hf(
                "Qwen3MoeForCausalLM", work / "tiny"
            ),
            "generated Qwen3-MoE (128 experts, top-8, hidden 256, expert width 128, 4 layers)": save_tiny_hf(
                "Qwen3MoeForCausalLM",
                work / "e128",
                hidden_size=256,
                intermediate_size=1024,
                moe_intermediate_size=128,
                num_experts=128,
                num_experts_per_tok=8,
                head_dim=64,
                mlp_only_layers=[],
            ),
        }
        for label, model in models.items():
            t = timings(work, model, args.repeats)
            rows.append(
                f"| {label} | {t['full_bytes'] / 2**20:.2f} | {t['adapter_bytes'] / 2**20:.2f} | "
                f"{t['full_bytes'] / t['adapter_bytes']:.1f}x | {t['full_s']:.3f} | {t['adapter_tensors_s']:.3f} | "
                f"{t['adapter_disk_s']:.3f} | {t['full_s'] / t['adapter_tensors_s']:.1f}x |"
            )
    full, adapter = byte_counts(QWEN3_30B_A3B, 2)
    lines = [
        f"\n## Adapter-only vs full-weight sync (LoRA rank {LORA.rank} on every linear layer and every expert; fp32; "
        f"one embedded engine; median of {args.repeats})\n",
        "| model | full MiB | adapter MiB | bytes ratio | full sync s | adapter s (tensors) | adapter s (directory) | "
        "time ratio |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        f"\nQwen3-30B-A3B's shape in bf16 (bytes only): full {full / 2**30:.1f} GiB, adapters {adapter / 2**20:.0f} "
        f"MiB, {full / adapter:.0f}x fewer bytes.",
    ]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
