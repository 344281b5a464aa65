"""FP8 checkpoints (:func:`moerl.checkpoint.hf.save_fp8`): what SGLang and the embedded engine serve in FP8, and how
the checkpoint checks take them and refuse a wrong one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from moerl import fp8
from moerl.checkpoint.hf import (
    CheckpointError,
    HFReader,
    check_hf_tensors,
    copy_carried_files,
    fp8_checkpoint,
    read_config,
    save_fp8,
)
from moerl.models import family_for
from moerl.models.tiny import ARCHITECTURES, save_tiny_hf

# What SGLang holds in FP8 for Qwen2/3-MoE: every decoder layer's linear projection, nothing else.
QUANTIZED_MODULES = {
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",  # a dense layer's MLP
    "mlp.up_proj",
    "mlp.down_proj",
    "mlp.shared_expert.gate_proj",
    "mlp.shared_expert.up_proj",
    "mlp.shared_expert.down_proj",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """arch -> (HF directory, its FP8 checkpoint). Qwen3's source in shards with an index, its FP8 copy in shards
    too; Qwen2's (shared experts, tied embeddings) in one file each."""
    root = tmp_path_factory.mktemp("fp8")
    out = {}
    for arch in ARCHITECTURES:
        qwen3 = arch.startswith("Qwen3")
        src = save_tiny_hf(arch, root / f"{arch}-hf", max_shard_size="100KB" if qwen3 else None)
        out[arch] = src, save_fp8(src, root / f"{arch}-fp8", max_shard_bytes=60_000 if qwen3 else 2**31)
    return out


def _module(name: str) -> str:
    """A Hub tensor's module within its layer, an expert's as ``mlp.experts.proj``."""
    parts = name.removesuffix(".weight").split(".")[3:]
    return ".".join(p for p in parts if not p.isdigit())


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_fp8_quantizes_each_projection_as_moerl_fp8_and_keeps_the_rest(models, arch):
    src, out = models[arch]
    source, written = HFReader(src), HFReader(out)
    raw = read_config(src)
    family = family_for(raw)
    hub = family.hub_shapes(family.normalize(raw))
    quantized = {n for n in hub if fp8.is_quantized(n)}
    assert {_module(n) for n in quantized} == {
        m for m in QUANTIZED_MODULES | {f"mlp.experts.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    } & {_module(n) for n in hub}
    assert not any("gate.weight" in n or "norm" in n for n in quantized)  # router, shared-expert gate, norms
    assert written.names() == set(hub) | {fp8.scale_name(n) for n in quantized}
    assert len(set(written.file_of.values())) > 1 if arch.startswith("Qwen3") else True  # shards, with an index
    for name in hub:
        tensor = source.get(name)
        if name in quantized:
            q, scale = fp8.quantize(tensor)
            assert written.dtype(name) == fp8.FP8 and written.dtype(fp8.scale_name(name)) == torch.float32
            assert torch.equal(_bytes(written.get(name)), _bytes(q)), name
            assert torch.equal(written.get(fp8.scale_name(name)), scale), name
        else:
            assert torch.equal(_bytes(written.get(name)), _bytes(tensor)), name
    config = read_config(out)
    assert config["quantization_config"] == fp8.QUANTIZATION_CONFIG
    assert {k: v for k, v in config.items() if k != "quantization_config"} == raw
    for carried in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / carried).read_bytes() == (src / carried).read_bytes()
    cfg = family.normalize(config)
    assert fp8_checkpoint(cfg)
    assert check_hf_tensors(written, family, cfg) == torch.float32  # the dtype of the tensors not quantized
    assert not list(out.parent.glob(f".{out.name}.partial-*"))


def _rewritten(src, dst, change, config=None):
    """The HF directory ``src`` again in ``dst`` (one file), its tensors ``change``d in place, its config ``config``."""
    reader = HFReader(src)
    tensors = {name: reader.get(name) for name in reader.names()}
    change(tensors)
    dst.mkdir()
    copy_carried_files(src, dst)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _check(directory):
    raw = read_config(directory)
    family = family_for(raw)
    return check_hf_tensors(HFReader(directory), family, family.normalize(raw))


def test_a_wrong_fp8_checkpoint_is_refused_naming_what_is_wrong(models, tmp_path):
    src, out = models["Qwen2MoeForCausalLM"]
    name = "model.layers.0.self_attn.q_proj.weight"
    raw = read_config(out)

    def bf16_weight(t):
        t[name] = fp8.dequantize(t[name], t[fp8.scale_name(name)], torch.bfloat16)

    with pytest.raises(CheckpointError, match=rf"quantized tensors are not FP8, e\.g\. {name} \(torch\.bfloat16\)"):
        _check(_rewritten(out, tmp_path / "bf16", bf16_weight))
    with pytest.raises(CheckpointError, match=r"scales are not float32"):
        _check(
            _rewritten(
                out, tmp_path / "half", lambda t: t.update({fp8.scale_name(name): t[fp8.scale_name(name)].half()})
            )
        )
    with pytest.raises(CheckpointError, match=rf"1 FP8 scales missing, e\.g\. \['{fp8.scale_name(name)}'\]"):
        _check(_rewritten(out, tmp_path / "no-scale", lambda t: t.pop(fp8.scale_name(name))))
    with pytest.raises(CheckpointError, match=r"FP8 scales missing.*none at all: not an FP8 checkpoint"):
        _check(_rewritten(src, tmp_path / "plain", lambda t: None, config=raw))
    without = {k: v for k, v in raw.items() if k != "quantization_config"}
    with pytest.raises(CheckpointError, match=r"_scale_inv.*FP8 scales: an FP8 checkpoint.*no quantization_config"):
        _check(_rewritten(out, tmp_path / "no-config", lambda t: None, config=without))
    with pytest.raises(CheckpointError, match=r"quantization_config .* is not supported: moerl serves only block-wise"):
        _check(
            _rewritten(
                out, tmp_path / "blocks", lambda t: None, config=raw | {"quantization_config": {"quant_method": "fp8"}}
            )
        )
    with pytest.raises(CheckpointError, match=r"is not supported"):
        fp8_checkpoint({"quantization_config": {"quant_method": "awq", "bits": 4}})


def test_save_fp8_refuses_an_existing_output_and_an_fp8_source(models, tmp_path):
    src, out = models["Qwen2MoeForCausalLM"]
    with pytest.raises(CheckpointError, match="already exists"):
        save_fp8(src, out)
    with pytest.raises(CheckpointError, match="is an FP8 checkpoint already"):
        save_fp8(out, tmp_path / "again")
    assert not (tmp_path / "again").exists()
