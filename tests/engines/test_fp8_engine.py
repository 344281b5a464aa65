"""The embedded engine serving an FP8 checkpoint (:mod:`moerl.engines.embedded.fp8`): SGLang's block-wise FP8 weights
and per-token-group FP8 activations emulated on the CPU, and weight pushes of FP8 weights and their scales."""

from __future__ import annotations

import contextlib
import json
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from moerl import fp8
from moerl.checkpoint.hf import CheckpointError, HFReader, save_fp8
from moerl.engines import protocol
from moerl.engines.embedded.engine import EmbeddedEngine
from moerl.engines.protocol import ProtocolError
from moerl.engines.weight_group import flatten_bucket, unflatten_bucket
from moerl.errors import LoRAError
from moerl.models.tiny import ARCHITECTURES, save_tiny_hf

PROMPT = [3, 17, 42, 99, 7, 120, 64, 5, 31, 200, 11, 77]
LONG_PROMPT = [(7 * i * i + 3 * i + 11) % 250 for i in range(240)]  # long enough for FP8 to flip an expert choice
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """arch -> (a tiny model, its FP8 checkpoint, another model's FP8 checkpoint, that other model)."""
    root = tmp_path_factory.mktemp("fp8-engine")
    out = {}
    for arch in ARCHITECTURES:
        src, other = save_tiny_hf(arch, root / f"{arch}-a"), save_tiny_hf(arch, root / f"{arch}-b", seed=1)
        out[arch] = src, save_fp8(src, root / f"{arch}-a-fp8"), save_fp8(other, root / f"{arch}-b-fp8"), other
    return out


@contextlib.contextmanager
def serving(engine: EmbeddedEngine):
    engine.scheduler.start()
    try:
        yield engine
    finally:
        engine.scheduler.stop()


def prompt_pass(engine: EmbeddedEngine, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The engine's log-probs of ``prompt``'s tokens after the first, and its routed experts at each prompt position
    (MoE layers), from one /generate."""
    [answer] = engine.generate(
        {
            "input_ids": prompt,
            "return_logprob": True,
            "logprob_start_len": 0,
            "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        }
    )
    meta = answer["meta_info"]
    logprobs = [lp for lp, _, _ in meta["input_token_logprobs"]]
    assert logprobs[0] is None
    shape = engine.family.model_shape(engine.hub_config)
    routing = protocol.decode_routed_experts(
        meta["routed_experts"], shape.num_layers, shape.topk, shape.moe_layers, shape.num_experts
    )
    return np.asarray(logprobs[1:], dtype=np.float64), routing[: len(prompt)]


# ---- an independent reference: plain transformers, FP8 by hand ------------------------------------------------------


def fp8_reference(src, fp8_dir) -> torch.nn.Module:
    """The model of ``src`` (fp32) computing as an FP8 engine does with ``fp8_dir``'s weights: each quantized weight
    set to dequantize(q, scales), each quantized linear's input through quantize_activations (pre-hooks; the experts by
    a loop of this test's own)."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    reader = HFReader(fp8_dir)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in reader.names():
            if not fp8.is_quantized(name):
                continue
            weight = fp8.dequantize(reader.get(name), reader.get(fp8.scale_name(name)))
            expert = _EXPERT.fullmatch(name)
            if expert is None:
                params[name].copy_(weight)
                continue
            prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
            if proj == "down_proj":
                params[prefix + "down_proj"][e].copy_(weight)
            else:
                rows = weight.shape[0]
                start = 0 if proj == "gate_proj" else rows
                params[prefix + "gate_up_proj"][e, start : start + rows].copy_(weight)
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and fp8.is_quantized(f"{path}.weight"):
            module.register_forward_pre_hook(lambda m, args: (fp8.quantize_activations(args[0]),))
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            module.forward = _reference_experts(module)
    return model


def _reference_experts(experts):
    def forward(hidden, top_k_index, top_k_weights):
        x = fp8.quantize_activations(hidden)
        out = torch.zeros_like(hidden)
        for e in range(experts.gate_up_proj.shape[0]):
            hit = top_k_index == e  # [tokens, top-k]
            rows = hit.any(-1).nonzero().squeeze(-1)
            if not len(rows):
                continue
            gate, up = (x[rows] @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
            y = fp8.quantize_activations(F.silu(gate) * up) @ experts.down_proj[e].T
            out[rows] += y * (top_k_weights * hit)[rows].sum(-1, keepdim=True)
        return out

    return forward


def reference_pass(model, prompt: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    logprobs = torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None]).squeeze(1)
    topk = model.config.num_experts_per_tok
    routing = torch.stack([torch.topk(r.float(), topk, -1).indices for r in out.router_logits], dim=1)
    return logprobs.double().numpy(), routing.numpy()


# ---- the tests -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_fp8_engine_log_probs_and_routing_equal_an_independent_fp8_reference(models, arch):
    src, fp8_dir, _, _ = models[arch]
    with serving(EmbeddedEngine(str(fp8_dir), device="cpu")) as engine:
        for prompt in (PROMPT, LONG_PROMPT):
            logprobs, routing = prompt_pass(engine, prompt)
            expected, expected_routing = reference_pass(fp8_reference(src, fp8_dir), prompt)
            np.testing.assert_allclose(logprobs, expected, rtol=0, atol=1e-5)
            assert np.array_equal(np.sort(routing, -1), np.sort(expected_routing, -1))


def test_fp8_engine_differs_from_the_unquantized_engine_on_the_same_weights(models):
    src, fp8_dir, _, _ = models["Qwen3MoeForCausalLM"]
    with serving(EmbeddedEngine(str(fp8_dir), device="cpu")) as quantized:
        fp8_logprobs, fp8_routing = prompt_pass(quantized, LONG_PROMPT)
    with serving(EmbeddedEngine(str(src), device="cpu")) as plain:
        logprobs, routing = prompt_pass(plain, LONG_PROMPT)
    assert np.abs(fp8_logprobs - logprobs).max() > 1e-3  # the FP8 policy is another function
    flipped = (np.sort(fp8_routing, -1) != np.sort(routing, -1)).any(-1)  # [positions, MoE layers]
    assert flipped.any()  # what R3 replays into the trainer
    assert flipped.mean() < 1  # yet not every one


def test_fp8_engine_serves_in_bfloat16(models):
    _, fp8_dir, _, _ = models["Qwen2MoeForCausalLM"]
    with serving(EmbeddedEngine(str(fp8_dir), dtype=torch.bfloat16, device="cpu")) as engine:
        logprobs, _ = prompt_pass(engine, PROMPT)
        assert engine.model.dtype == torch.bfloat16 and np.isfinite(logprobs).all()
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(
            engine.model.get_parameter(name),
            fp8.dequantize(engine.fp8.q_view(name), engine.fp8.scale_view(name), torch.bfloat16),
        )


def test_startup_holds_the_checkpoints_fp8_weights_and_scales_exactly(models):
    _, fp8_dir, _, _ = models["Qwen3MoeForCausalLM"]
    engine = EmbeddedEngine(str(fp8_dir), device="cpu")
    reader = HFReader(fp8_dir)
    quantized = [n for n in reader.names() if fp8.is_quantized(n)]
    assert quantized and engine.fp8 is not None
    for name in quantized:
        q, scales = engine.fp8.q_view(name), engine.fp8.scale_view(name)
        assert q is not None and scales is not None, name
        assert torch.equal(q.view(torch.uint8), reader.get(name).view(torch.uint8)), name
        assert torch.equal(scales, reader.get(fp8.scale_name(name))), name
    # /get_weights_by_name: an FP8 weight's rows as floats (what SGLang returns for an fp8 parameter), its scales'
    expert = "model.layers.2.mlp.experts.5.up_proj.weight"
    assert engine.weight_values(expert, 3) == reader.get(expert)[:3].float().tolist()
    assert engine.weight_values(fp8.scale_name(expert), 3) == reader.get(fp8.scale_name(expert)).tolist()
    assert engine.weight_values("model.norm.weight", 3) == reader.get("model.norm.weight")[:3].tolist()
    assert engine.weight_values("model.layers.0.mlp.gate.weight_scale_inv", 3) is None


def _other_model_pushed(engine: EmbeddedEngine, other_fp8, how: str) -> None:
    if how == "disk":  # /update_weights_from_disk
        engine.apply_weights(engine.read_model_dir(str(other_fp8)), "1", abort_all=False, flush=True)
        return
    reader = HFReader(other_fp8)
    named = [(n, reader.get(n)) for n in sorted(reader.names())]
    # Buckets of 7 through the broadcast's wire format: a weight and its scales land in different buckets too.
    for start in range(0, len(named), 7):
        flat, names, dtypes, shapes = flatten_bucket(named[start : start + 7])
        engine.apply_weights(unflatten_bucket(flat, names, dtypes, shapes), "1", abort_all=False, flush=True)


@pytest.mark.parametrize("how", ["buckets", "disk"])
def test_pushing_fp8_weights_equals_starting_from_their_fp8_checkpoint(models, how):
    _, fp8_dir, other_fp8, _ = models["Qwen3MoeForCausalLM"]
    with serving(EmbeddedEngine(str(fp8_dir), device="cpu")) as pushed:
        before, _ = prompt_pass(pushed, PROMPT)
        pushed.scheduler.call(lambda: _other_model_pushed(pushed, other_fp8, how)).result(60)
        after, after_routing = prompt_pass(pushed, PROMPT)
        checksum = pushed.scheduler.call(pushed.checksum).result(60)
    with serving(EmbeddedEngine(str(other_fp8), device="cpu")) as started:
        expected, expected_routing = prompt_pass(started, PROMPT)
        assert checksum == started.scheduler.call(started.checksum).result(60)
    assert not np.allclose(before, after)
    assert np.array_equal(after, expected) and np.array_equal(after_routing, expected_routing)


def test_a_push_that_is_not_fp8_is_refused_and_changes_nothing(models):
    src, fp8_dir, other_fp8, other = models["Qwen3MoeForCausalLM"]
    engine = EmbeddedEngine(str(fp8_dir), device="cpu")
    checksum = engine.checksum()
    weight = HFReader(other).get(name := "model.layers.0.self_attn.q_proj.weight")
    q, scales = fp8.quantize(weight)
    norm = ("model.norm.weight", torch.ones(64))
    for named, message in (
        (
            [norm, (name, weight.bfloat16())],
            r"bfloat16 for a weight this engine serves in FP8 .*engines\.quantization=fp8",
        ),
        ([norm, (name, weight)], r"float32 for a weight this engine serves in FP8"),
        ([(name, q), (fp8.scale_name(name), scales.half())], r"FP8 scales are float32, not float16"),
        ([(fp8.scale_name(name), scales[:, :0])], r"shape \(1, 0\) != served \(1, 1\)"),
        (
            [("model.norm.weight", torch.ones(64).to(fp8.FP8))],
            r"float8_e4m3fn for a weight this engine serves unquantized",
        ),
    ):
        with pytest.raises(ProtocolError, match="nothing was changed: .*" + message):
            engine.apply_weights(named, "2", abort_all=False, flush=False)
    with pytest.raises(CheckpointError, match=r"FP8 scales missing.*none at all: not an FP8 checkpoint"):
        engine.read_model_dir(str(other))  # /update_weights_from_disk of an unquantized directory
    # /update_weights_from_distributed checks a bucket's names, dtypes and shapes before a byte comes
    meta = [(name, q.to("meta")), (fp8.scale_name(name), scales.to("meta"))]
    assert [dst.shape for dst, _ in engine.weight_targets(meta)] == [q.shape, scales.shape]
    with pytest.raises(ProtocolError, match=r"engines\.quantization=fp8"):
        engine.weight_targets([(name, weight.to("meta", torch.bfloat16))])
    assert engine.checksum() == checksum and engine.scheduler.weight_version != "2"

    plain = EmbeddedEngine(str(src), device="cpu")  # an unquantized engine takes no FP8
    for named, message in (
        ([(name, q)], r"float8_e4m3fn, and this engine serves unquantized weights"),
        ([(fp8.scale_name(name), scales)], r"not a weight of the served model \(FP8 scales"),
    ):
        with pytest.raises(ProtocolError, match=message):
            plain.apply_weights(named, "2", abort_all=False, flush=False)
    with pytest.raises(CheckpointError, match=r"FP8 scales: an FP8 checkpoint"):
        plain.read_model_dir(str(other_fp8))


def test_an_fp8_engine_refuses_lora_adapters_and_other_quantizations(models, tmp_path):
    _, fp8_dir, _, _ = models["Qwen2MoeForCausalLM"]
    engine = EmbeddedEngine(str(fp8_dir), device="cpu")
    with pytest.raises(LoRAError, match="serves an FP8 checkpoint, and LoRA adapters are not served"):
        engine.adapters.from_dir("policy", tmp_path)
    with pytest.raises(LoRAError, match="FP8"):
        engine.adapters.from_base64("policy", {"r": 8, "lora_alpha": 16}, "")
    config = json.loads((fp8_dir / "config.json").read_text())
    other = tmp_path / "int8"
    other.mkdir()
    for f in fp8_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"is not supported: moerl serves only block-wise FP8 checkpoints"):
        EmbeddedEngine(str(other), device="cpu")
