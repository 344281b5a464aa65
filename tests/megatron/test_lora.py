"""Per-expert LoRA: training on gloo ranks at several layouts, export to adapter directories, conversion, serving.

Three shapes: an all-MoE Qwen3-MoE (every MLP routed, as in Qwen3-30B-A3B), the tiny Qwen3-MoE with a dense layer
interleaved, and the tiny Qwen2-MoE (shared experts and their gate, dense layers, tied embeddings). Each exported
adapter must mean the merged model in the consumer its format is for: PEFT over transformers (``peft``) and the
embedded engine standing in for SGLang (``sglang``).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from moerl.checkpoint.convert import hf_to_mcore
from moerl.checkpoint.peft import export_adapter, peft_would_drop, save_adapter
from moerl.cli.convert_ckpt import main as convert_main
from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.engines.embedded.lora import AdapterConfig, AdapterSet
from moerl.engines.sglang import lora_target_modules
from moerl.errors import LoRAError
from moerl.megatron.launch import run_ranks
from moerl.megatron.lora_config import LoRAConfig
from moerl.models import family_for
from moerl.models.tiny import save_tiny_hf
from moerl.trainer.config import OptimConfig, TrainerConfig
from tests.trainer.test_trainer import rollout
from tests.workers import lora_train_export, save_and_resume

LORA = LoRAConfig(enabled=True, rank=4, alpha=8.0)
INPUT_IDS = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
STEPS = 2
# (name, layouts): EP1 first, the reference of the others; layouts in SAVED also save a checkpoint to export.
MODELS = {
    "qwen3-all-moe": [dict(), dict(ep=2), dict(tp=2), dict(tp=2, ep=2)],  # tp=2 alone: experts split over ETP 2
    "qwen3-dense": [dict(), dict(pp=2), dict(tp=2, ep=2)],
    "qwen2": [dict(), dict(pp=2), dict(tp=2, ep=2)],
}
SAVED = (dict(pp=2), dict(tp=2, ep=2))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_ckpts) -> dict:
    root = tmp_path_factory.mktemp("lora-models")
    hf = save_tiny_hf("Qwen3MoeForCausalLM", root / "qwen3-hf", mlp_only_layers=[])
    return {
        "qwen3-all-moe": (hf, hf_to_mcore(hf, root / "qwen3-mcore", progress=False)),
        "qwen3-dense": tiny_ckpts["Qwen3MoeForCausalLM"],
        "qwen2": tiny_ckpts["Qwen2MoeForCausalLM"],
    }


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
        for layout in layouts:
            cfg = trainer_config(**layout)
            world = max(layout.get("tp", 1), layout.get("ep", 1)) * layout.get("pp", 1)  # EP folds over the TP ranks
            save = (
                str(root / f"{name}-{'-'.join(f'{k}{v}' for k, v in layout.items())}-ckpt") if layout in SAVED else None
            )
            result = run_ranks(lora_train_export, world, str(mcore), cfg, LORA, samples, INPUT_IDS, STEPS, save)
            logits = next(r["logits"] for r in result if r["logits"] is not None)  # the last pipeline stage's
            out[name].append({**result[0], "logits": logits, "layout": layout, "checkpoint": save})
    return out


def _adapter_files(hf, lora: dict, fmt: str):
    raw = json.loads((hf / "config.json").read_text())
    family = family_for(raw)
    return export_adapter(family, family.normalize(raw), lora, LORA, fmt, str(hf))


@pytest.mark.e2e
def test_an_sglang_server_serves_the_modules_the_adapters_take(trained, models):
    """A LoRA SGLang server is started for lora.targets with the modules each export adapts: every one (SGLang refuses
    an adapter with a module its server was not started for), not ``all`` (which gives lm_head and embed_tokens LoRA
    buffers too), and the experts' whatever the targets (SGLang's LoRA MoE runner refuses to start without them)."""
    for name, runs in trained.items():
        hf, _ = models[name]
        assert (
            lora_target_modules(hf, LORA.targets)
            == _adapter_files(hf, runs[0]["lora"], "sglang").config["target_modules"]
        ), name
    hf, _ = models["qwen2"]
    assert lora_target_modules(hf, ["linear_qkv"]) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert lora_target_modules(hf, ["*.local_experts.*.linear_fc1", "linear_proj"]) == [
        "down_proj",
        "gate_proj",
        "o_proj",
        "up_proj",
    ]
    with pytest.raises(ValueError, match="match no linear layer"):
        lora_target_modules(hf, ["linear_qkvz"])


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_layouts_train_the_same_adapters(trained):
    """From the same init and data, EP2, TP2+SP (experts split too), TP2+SP+EP2 and PP2 export the EP1 run's
    adapters."""
    for name, (reference, *others) in trained.items():
        ref = reference["lora"]
        assert all(v.abs().max() > 0 for k, v in ref.items() if k.endswith("lora_B"))  # every B moved off zero
        for run in others:
            assert run["lora"].keys() == ref.keys()
            worst = max(((run["lora"][k] - ref[k]).norm() / ref[k].norm()).item() for k in ref)
            assert worst < 1e-5, (name, run["layout"], worst)
            assert abs(run["metrics"][-1]["train/loss"] - reference["metrics"][-1]["train/loss"]) < 1e-5


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_export_means_the_trained_model_in_its_consumer(trained, models, tmp_path, capsys, name):
    """Every saved checkpoint (TP2+EP2; PP2 where there are dense layers): merged export == Megatron+LoRA; the
    peft-format adapter under PEFT == merged; the sglang-format adapter served by the embedded engine == merged."""
    from peft import AutoPeftModelForCausalLM

    hf, _ = models[name]
    for run in (r for r in trained[name] if r["checkpoint"]):
        where = tmp_path / "-".join(f"{k}{v}" for k, v in run["layout"].items())
        merged = where / "merged"
        assert (
            convert_main(
                ["mcore-to-hf", "--mcore", run["checkpoint"], "--out", str(merged), "--merge-lora", "--no-progress"]
            )
            == 0
        )
        with torch.no_grad():
            merged_logits = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(INPUT_IDS).logits
        assert (merged_logits - run["logits"]).abs().max() < 1e-4, run["layout"]

        for fmt in ("peft", "sglang"):
            adapter = where / fmt
            assert (
                convert_main(
                    [
                        "mcore-to-hf",
                        "--mcore",
                        run["checkpoint"],
                        "--out",
                        str(adapter),
                        "--adapter-only",
                        "--adapter-format",
                        fmt,
                        "--no-progress",
                    ]
                )
                == 0
            )
            config = json.loads((adapter / "adapter_config.json").read_text())
            assert config["r"] == LORA.rank and config["base_model_name_or_path"] == str(hf.resolve())
        # PEFT finds the base model from the adapter alone and applies every module.
        with torch.no_grad():
            peft_logits = (
                AutoPeftModelForCausalLM.from_pretrained(where / "peft", dtype=torch.float32).eval()(INPUT_IDS).logits
            )
            plain = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(INPUT_IDS).logits
        assert (peft_logits - merged_logits).abs().max() < 1e-4, (name, run["layout"])
        assert (peft_logits - plain).abs().max() > 1e-2  # the adapter changes the model
        # The embedded engine serving the sglang-format adapter samples what the merged model does.
        with_adapter, from_merged = serve(hf, where / "sglang"), serve(merged)
        assert [ids for ids, _ in with_adapter] == [ids for ids, _ in from_merged]
        assert all(
            abs(x - y) < 1e-4
            for (_, a), (_, b) in zip(with_adapter, from_merged, strict=True)
            for x, y in zip(a, b, strict=True)
        )

    # A LoRA checkpoint converted as if it held full weights would silently drop the training; an adapter needs its
    # consumer.
    assert (
        convert_main(["mcore-to-hf", "--mcore", run["checkpoint"], "--out", str(tmp_path / "plain"), "--no-progress"])
        == 2
    )
    assert (
        convert_main(
            [
                "mcore-to-hf",
                "--mcore",
                run["checkpoint"],
                "--out",
                str(tmp_path / "a"),
                "--adapter-only",
                "--no-progress",
            ]
        )
        == 2
    )
    assert "--adapter-format peft" in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(MODELS))
def test_what_peft_would_drop_is_named_and_is_what_peft_drops(trained, models, tmp_path, name):
    """PEFT over transformers 5 loads parts of the sglang layout into nothing: the modules the export warns about
    are exactly those, since PEFT's model equals the base with every adapter merged but them."""
    from peft import PeftModel

    from moerl.checkpoint.peft import hub_factors
    from moerl.engines.embedded.runner import hub_tensor_view

    hf, _ = models[name]
    raw = json.loads((hf / "config.json").read_text())
    family = family_for(raw)
    lora = trained[name][0]["lora"]
    files = _adapter_files(hf, lora, "sglang")
    dropped = set(peft_would_drop(files, family.model_type))
    assert bool(dropped) == (name != "qwen3-all-moe")  # Qwen3's dense MLPs; Qwen2's experts
    expected = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    params = dict(expected.named_parameters())
    with torch.no_grad():
        for module, (a, b) in hub_factors(family, family.normalize(raw), lora).items():
            if module not in dropped:
                hub_tensor_view(family, params, module + ".weight").add_(LORA.scale * (b @ a))
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32), save_adapter(tmp_path / "a", files)
        )
        got = peft_model.eval()(INPUT_IDS).logits
        assert (got - expected(INPUT_IDS).logits).abs().max() < 1e-4
        if dropped:  # so PEFT's model is not the trained one
            assert (got - trained[name][0]["logits"]).abs().max() > 1e-3


@pytest.mark.e2e
def test_a_planted_drop_is_detected(trained, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    run = next(r for r in trained["qwen2"] if r["checkpoint"])
    adapter = tmp_path / "adapter"
    assert (
        convert_main(
            [
                "mcore-to-hf",
                "--mcore",
                run["checkpoint"],
                "--out",
                str(adapter),
                "--adapter-only",
                "--adapter-format",
                "peft",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        convert_main(
            ["check-adapter", "--mcore", run["checkpoint"], "--adapter", str(adapter), "--adapter-format", "peft"]
        )
        == 0
    )
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    planted = [k for k in tensors if ".shared_expert.down_proj." in k]
    save_file({k: v for k, v in tensors.items() if k not in planted}, str(adapter / "adapter_model.safetensors"))
    capsys.readouterr()
    assert (
        convert_main(
            ["check-adapter", "--mcore", run["checkpoint"], "--adapter", str(adapter), "--adapter-format", "peft"]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert f"{len(planted)} tensor(s) missing" in err and "shared_expert.down_proj" in err


@pytest.mark.e2e
def test_the_engine_refuses_the_peft_layout_with_what_to_do(trained, models):
    hf, _ = models["qwen2"]
    files = _adapter_files(hf, trained["qwen2"][0]["lora"], "peft")
    adapters = AdapterSet(
        AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32),
        family_for(json.loads((hf / "config.json").read_text())),
    )
    with pytest.raises(LoRAError, match="--adapter-format sglang"):
        adapters.from_tensors("p", AdapterConfig.of("adapter_config.json", files.config), files.tensors)


@pytest.mark.e2e
def test_lora_trainer_resumes_exactly(models, rollouts, tmp_path):
    """Adapters, their optimizer state, the schedule and the version come back from a checkpoint: one step
    after resuming equals the second step of a run never interrupted."""
    _, mcore = models["qwen2"]
    out = run_ranks(
        save_and_resume, 2, str(mcore), trainer_config(ep=2), rollouts["qwen2"], str(tmp_path / "ckpt"), LORA
    )[0]
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
        body = {
            "input_ids": INPUT_IDS[0].tolist(),
            "return_logprob": True,
            "lora_path": "trained" if adapter else None,
            "sampling_params": {"n": 2, "max_new_tokens": 6, "top_k": 8, "sampling_seed": 3, "ignore_eos": True},
        }
        return [
            (r["output_ids"], [x[0] for x in r["meta_info"]["output_token_logprobs"]]) for r in engine.generate(body)
        ]
    finally:
        engine.scheduler.stop()


def test_bad_lora_config():
    with pytest.raises(LoRAError, match="rank"):
        LoRAConfig(enabled=True, rank=0)
    with pytest.raises(LoRAError, match="dropout"):
        LoRAConfig(enabled=True, dropout=1.0)
    assert LoRAConfig(targets=["*.local_experts.*.linear_fc1"]).targets_module(
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1"
    )
    assert not LoRAConfig(targets=["*.local_experts.*.linear_fc1"]).targets_module(
        "decoder.layers.0.mlp.shared_experts.linear_fc1"
    )


@pytest.mark.e2e
@pytest.mark.sglang
def test_sglangs_loader_reads_every_module_of_the_sglang_format(trained, models, tmp_path, sglang_python):
    """SGLang 0.5.23's own adapter parsing (config, names, q/k/v and gate/up stacking, expert ids, the shared-outer
    detection) over the sglang-format files of each model, in SGLang's interpreter: every trained module lands, once,
    with its factors and scale."""
    from moerl.checkpoint.peft import hub_factors
    from tests.engine_server import ask_sglang

    adapters = {}
    for name in sorted(MODELS):
        hf, _ = models[name]
        directory = save_adapter(tmp_path / name, _adapter_files(hf, trained[name][0]["lora"], "sglang"))
        adapters[name] = {"adapter": str(directory), "model": str(hf)}
    read = ask_sglang(sglang_python, {"lora": {"adapters": adapters}}, tmp_path)["lora"]
    for name in sorted(MODELS):
        hf, _ = models[name]
        raw = json.loads((hf / "config.json").read_text())
        family = family_for(raw)
        expected = hub_factors(family, family.normalize(raw), trained[name][0]["lora"])
        theirs = read[name]
        assert theirs["scaling"] == LORA.scale and theirs["shared_outer"] == [], name  # per expert, not shared-outer
        seen = []
        for module in theirs["modules"].values():
            parts, a, b = module["parts"], torch.tensor(module["a"]), torch.tensor(module["b"])
            rows = [expected[p][1].shape[0] for p in parts]
            for part, a_part, b_part in zip(parts, a.chunk(len(parts)), b.split(rows), strict=True):
                assert torch.equal(a_part, expected[part][0].float()), (name, part)
                assert torch.equal(b_part, expected[part][1].float()), (name, part)
            seen += parts
        assert sorted(seen) == sorted(expected), name
