"""Per-expert LoRA: training on gloo ranks at several layouts, export to PEFT, conversion, serving.

Two models: an all-MoE Qwen3-MoE (every MLP a routed-expert layer, as in Qwen3-30B-A3B), whose
exported adapter PEFT itself loads over transformers; and the tiny Qwen2-MoE (shared experts, dense
layers, tied embeddings), checked against the model with the adapters merged into its weights
(PEFT 0.21 maps per-expert adapters onto transformers 5's fused experts for Qwen3-MoE only, and then
drops dense-layer and shared-expert MLP adapters).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.checkpoint.cli import main as convert_main
from moerl.checkpoint.convert import hf_to_mcore
from moerl.checkpoint.peft import adapter_config, peft_tensors, save_adapter
from moerl.engines.embedded.lora import AdapterSet
from moerl.engines.embedded.server import EmbeddedEngine
from moerl.megatron.launch import run_ranks
from moerl.megatron.lora import LoRAConfig, LoRAError
from moerl.models import family_for
from moerl.models.tiny import save_tiny_hf
from moerl.trainer.config import OptimConfig, TrainerConfig
from tests.test_trainer import rollout
from tests.workers import lora_train_export, save_and_resume

LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)
INPUT_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
STEPS = 2
# (name, layouts): EP1 first, the reference of the others; the last one also saves a checkpoint.
MODELS = {
    "qwen3-all-moe": [dict(), dict(ep=2), dict(tp=2), dict(tp=2, ep=2)],  # tp=2 alone: experts split over ETP 2
    "qwen2": [dict(), dict(pp=2), dict(tp=2, ep=2)],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_ckpts) -> dict:
    root = tmp_path_factory.mktemp("lora-models")
    hf = save_tiny_hf("Qwen3MoeForCausalLM", root / "qwen3-hf", mlp_only_layers=[])
    return {"qwen3-all-moe": (hf, hf_to_mcore(hf, root / "qwen3-mcore", progress=False)),
            "qwen2": tiny_ckpts["Qwen2MoeForCausalLM"]}


@pytest.fixture(scope="module")
def rollouts(models) -> dict:
    return {name: rollout(hf, torch.float32) for name, (hf, _) in models.items()}


def trainer_config(**layout) -> TrainerConfig:
    # A large Adam epsilon keeps near-zero gradients from becoming full-size sign updates, which would
    # turn float rounding differences between layouts into visible adapter differences.
    return TrainerConfig(micro_batch_tokens=64, optim=OptimConfig(lr=5e-2, adam_eps=1e-2), **layout)


@pytest.fixture(scope="module")
def trained(models, rollouts, tmp_path_factory) -> dict:
    """name -> list of per-layout results (rank 0) of the same LoRA steps on the same rollouts."""
    root = tmp_path_factory.mktemp("lora-runs")
    out = {}
    for name, layouts in MODELS.items():
        hf, mcore = models[name]
        samples = rollouts[name]
        out[name] = []
        for i, layout in enumerate(layouts):
            cfg = trainer_config(**layout)
            world = max(layout.get("tp", 1), layout.get("ep", 1)) * layout.get("pp", 1)  # EP folds over the TP ranks
            save = str(root / f"{name}-ckpt") if i == len(layouts) - 1 else None
            result = run_ranks(lora_train_export, world, str(mcore), cfg, LORA, samples, INPUT_IDS, STEPS, save)
            logits = next(r["logits"] for r in result if r["logits"] is not None)  # the last pipeline stage's
            out[name].append({**result[0], "logits": logits, "layout": layout, "checkpoint": save})
    return out


def _peft_dir(tmp_path, name: str, hf, lora: dict):
    raw = json.loads((hf / "config.json").read_text())
    family = family_for(raw)
    tensors = peft_tensors(family, family.normalize(raw), lora)
    return save_adapter(tmp_path / f"{name}-adapter", adapter_config(LORA, tensors), tensors)


def test_only_adapters_train(trained):
    for name, runs in trained.items():
        for run in runs:
            assert run["trainable"] == run["lora_names"] == run["with_state"], (name, run["layout"])
            assert run["base_unchanged"], (name, run["layout"])
            assert all(m["train/grad_norm"] > 0 for m in run["metrics"])
        names = set(trained[name][0]["lora"])
        assert any(".local_experts.7.linear_fc1.lora_B" in n for n in names)  # each expert its own pair
        assert any("self_attention.linear_qkv.lora_A" in n for n in names)
    assert any(".shared_experts.linear_fc2.lora_A" in n for n in trained["qwen2"][0]["lora"])


def test_layouts_train_the_same_adapters(trained):
    """From the same init and data, EP2, TP2+SP (experts split too), TP2+SP+EP2 and PP2 export the EP1 run's adapters."""
    for name, (reference, *others) in trained.items():
        ref = reference["lora"]
        assert all(v.abs().max() > 0 for k, v in ref.items() if k.endswith("lora_B"))  # every B moved off zero
        for run in others:
            assert run["lora"].keys() == ref.keys()
            worst = max(((run["lora"][k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
            assert worst < 1e-5, (name, run["layout"], worst)
            assert abs(run["metrics"][-1]["train/loss"] - reference["metrics"][-1]["train/loss"]) < 1e-5


def test_exported_adapter_matches_peft_and_merged_models(trained, models, tmp_path):
    from peft import PeftModel

    hf, _ = models["qwen3-all-moe"]
    run = trained["qwen3-all-moe"][-1]  # TP2+EP2: adapters gathered across TP shards and EP ranks
    adapter = _peft_dir(tmp_path, "qwen3", hf, run["lora"])
    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = base(INPUT_IDS).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(INPUT_IDS).logits
    assert (peft_logits - plain).abs().max() > 1e-2  # the adapter changes the model
    assert (peft_logits - run["logits"]).abs().max() < 1e-4

    hf, _ = models["qwen2"]
    run = trained["qwen2"][-1]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    adapters = AdapterSet(model)
    adapters.add(adapters.from_dir("trained", _peft_dir(tmp_path, "qwen2", hf, run["lora"])))
    adapters.activate("trained")
    with torch.no_grad():
        assert (model(INPUT_IDS).logits - run["logits"]).abs().max() < 1e-4


def test_convert_adapter_only_and_merged(trained, models, tmp_path, capsys):
    for name, runs in trained.items():
        hf, _ = models[name]
        run = runs[-1]
        adapter, merged = tmp_path / f"{name}-adapter", tmp_path / f"{name}-merged"
        assert convert_main(["mcore-to-hf", "--mcore", run["checkpoint"], "--out", str(adapter), "--adapter-only", "--no-progress"]) == 0
        raw = json.loads((hf / "config.json").read_text())
        family = family_for(raw)
        expected = peft_tensors(family, family.normalize(raw), run["lora"])
        from safetensors.torch import load_file

        written = load_file(str(adapter / "adapter_model.safetensors"))
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[k], expected[k]) for k in expected)  # saved at TP2+EP2, read at TP1
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["r"] == LORA.rank
        assert config["base_model_name_or_path"] == str(hf.resolve())  # the model the checkpoint was converted from
        if name == "qwen3-all-moe":  # PEFT finds the base model from the adapter alone
            from peft import AutoPeftModelForCausalLM

            with torch.no_grad():
                logits = AutoPeftModelForCausalLM.from_pretrained(adapter, dtype=torch.float32).eval()(INPUT_IDS).logits
            assert (logits - run["logits"]).abs().max() < 1e-4

        assert convert_main(["mcore-to-hf", "--mcore", run["checkpoint"], "--out", str(merged), "--merge-lora", "--no-progress"]) == 0
        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
        with torch.no_grad():
            assert (model(INPUT_IDS).logits - run["logits"]).abs().max() < 1e-4

        # The embedded engine serving the adapter over the base model samples what the merged model does.
        with_adapter, from_merged, from_base = serve(hf, adapter), serve(merged), serve(hf)
        assert [ids for ids, _ in with_adapter] == [ids for ids, _ in from_merged]
        assert all(abs(x - y) < 1e-4 for (_, a), (_, b) in zip(with_adapter, from_merged) for x, y in zip(a, b))
        assert with_adapter != from_base

    # A LoRA checkpoint converted as if it held full weights would silently drop the training.
    assert convert_main(["mcore-to-hf", "--mcore", run["checkpoint"], "--out", str(tmp_path / "plain"), "--no-progress"]) == 2
    assert "--adapter-only" in capsys.readouterr().err


def test_lora_trainer_resumes_exactly(models, rollouts, tmp_path):
    """Adapters, their optimizer state, the schedule and the version come back from a checkpoint: one step
    after resuming equals the second step of a run never interrupted."""
    _, mcore = models["qwen2"]
    out = run_ranks(save_and_resume, 2, str(mcore), trainer_config(ep=2), rollouts["qwen2"], str(tmp_path / "ckpt"), LORA)[0]
    assert out["version"] == 2 and out["got"]["train/loss"] != out["first"]["train/loss"]
    for key in ("train/loss", "train/grad_norm"):
        assert out["got"][key] == out["expected"][key], key
    for name, tensor in out["expected_weights"].items():
        assert torch.equal(out["weights"][name], tensor), name


def serve(model_dir, adapter=None) -> list:
    """Token ids and log-probs of seeded samples from an in-process embedded engine (with ``adapter``)."""
    engine = EmbeddedEngine(str(model_dir), dtype=torch.float32, device="cpu")
    if adapter is not None:
        engine.adapters.add(engine.adapters.from_dir("trained", adapter))
    engine.scheduler.start()
    try:
        body = {"input_ids": INPUT_IDS[0].tolist(), "return_logprob": True, "lora_path": "trained" if adapter else None,
                "sampling_params": {"n": 2, "max_new_tokens": 6, "top_k": 8, "sampling_seed": 3, "ignore_eos": True}}
        return [(r["output_ids"], [x[0] for x in r["meta_info"]["output_token_logprobs"]]) for r in engine.generate(body)]
    finally:
        engine.scheduler.stop()


def test_bad_lora_config():
    with pytest.raises(LoRAError, match="rank"):
        LoRAConfig(enabled=True, rank=0)
    with pytest.raises(LoRAError, match="dropout"):
        LoRAConfig(enabled=True, dropout=1.0)
    assert LoRAConfig(targets=["*.local_experts.*.linear_fc1"]).targets_module("decoder.layers.0.mlp.experts.local_experts.3.linear_fc1")
    assert not LoRAConfig(targets=["*.local_experts.*.linear_fc1"]).targets_module("decoder.layers.0.mlp.shared_experts.linear_fc1")
