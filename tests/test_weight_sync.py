"""Weight export for engine sync: at any layout, the stream is the HF checkpoint, bitwise."""

from __future__ import annotations

import pytest
import torch

from moerl.checkpoint.hf import HFReader
from moerl.layout import Layout
from moerl.megatron.launch import run_ranks
from tests.conftest import ARCHS
from tests.workers import export_hf


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("world, layout", [(2, Layout(tp=2)), (2, Layout(ep=2)), (2, Layout(pp=2)), (4, Layout(tp=2, ep=2, pp=2))],
                         ids=["TP2", "EP2", "PP2", "TP2xEP2xPP2"])
def test_export_streams_the_hf_checkpoint_bitwise_and_only_rank_0_takes_in_the_model(tiny_ckpts, arch, world, layout):
    hf_dir, mcore_dir = tiny_ckpts[arch]
    reader = HFReader(hf_dir)
    ranks = run_ranks(export_hf, world, str(mcore_dir), layout)
    stream = ranks[0]["stream"]
    names = [name for name, _ in stream]
    assert sorted(names) == sorted(reader.names()) and len(set(names)) == len(names)
    for name, tensor in stream:
        assert torch.equal(tensor, reader.get(name)), name

    def nbytes(names):
        return sum(reader.get(n).numel() * reader.get(n).element_size() for n in names)

    model_bytes = nbytes(reader.names())
    assert 0 < ranks[0]["received"] < model_bytes
    for rank, out in enumerate(ranks[1:], start=1):
        assert out["stream"] == []  # only rank 0 sends to the engines
        if not out["lead"]:
            assert out["received"] == 0, rank  # it only sends its shards
            continue
        # A later stage's first rank takes in less than its own stage's tensors: its TP and EP peers' shards.
        stage = [n for n in reader.names() if (int(n.split(".")[2]) in out["layers"] if n.startswith("model.layers.") else out["last"])]
        assert out["received"] < nbytes(stage), rank
        assert (out["received"] > 0) == (layout.tp > 1 or layout.ep > 1), rank


@pytest.mark.parametrize("layout", [{"ep": 2}, {"pp": 2}], ids=["EP2", "PP2"])
def test_after_a_broadcast_sync_the_engine_holds_the_trainers_weights_bitwise(tiny_ckpts, tmp_path, layout):
    from moerl.trainer.config import OptimConfig, TrainerConfig
    from tests.engine_server import running_server
    from tests.test_trainer import rollout
    from tests.workers import train_then_sync

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    samples = rollout(hf_dir, torch.float32)
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-2), **layout)
    with running_server(hf_dir, tmp_path / "logs") as url:
        out = run_ranks(train_then_sync, 2, str(mcore_dir), cfg, samples, url)[0]
    reader = HFReader(hf_dir)
    stats = out["stats"]
    assert stats.buckets > 1 and stats.tensors == len(reader.names())
    assert out["versions"] == ["1"]  # the policy version after one step
    changed = 0
    for name, tensor in out["trained"]:
        assert torch.equal(torch.tensor(out["served"][name], dtype=tensor.dtype), tensor), name
        changed += not torch.equal(tensor, reader.get(name))
    assert changed > len(out["trained"]) // 2  # the step moved the weights the engine now serves
