"""The Megatron model against transformers' own Qwen MoE models, at every parallel layout (gloo ranks):
logits, routing record/replay, and the gradient of a fixed loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from moerl.layout import Layout
from moerl.megatron.launch import run_ranks
from moerl.models import family_for
from tests.conftest import ARCHS, hub_grads
from tests.workers import parity

pytestmark = pytest.mark.e2e  # each test starts moerl processes (see pytest.ini)

ALLGATHER = {"moe_token_dispatcher_type": "allgather"}
LAYOUTS = {  # name: (layout, world size, TransformerConfig overrides)
    "TP1": (Layout(), 1, {}),
    "TP2+SP": (Layout(tp=2), 2, {}),
    "EP2": (Layout(ep=2), 2, {}),
    "TP2+EP2": (Layout(tp=2, ep=2), 2, {}),
    "PP2": (Layout(pp=2), 2, {}),
    "EP2-allgather": (Layout(ep=2), 2, ALLGATHER),
    "TP2+EP2-allgather": (Layout(tp=2, ep=2), 2, ALLGATHER),
    "TP2+EP2+PP2": (Layout(tp=2, ep=2, pp=2), 4, {}),
}


@pytest.fixture(scope="module")
def reference(tiny_ckpts):
    """HF logits and, under full Megatron parameter names, HF gradients of the next-token loss."""
    refs = {}
    torch.manual_seed(0)
    input_ids = torch.randint(0, 256, (2, 16))
    for arch, (hf_dir, _) in tiny_ckpts.items():
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        logits = model(input_ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))
        loss.backward()
        hub = hub_grads(model)
        family = family_for(model.config.to_dict())
        cfg = family.normalize(model.config.to_dict())
        grads = {r.mcore: family.to_mcore(r, [hub[n] for n in r.hf], cfg) for r in family.all_rules(cfg)}
        refs[arch] = dict(logits=logits.detach(), loss=loss.item(), grads=grads, cfg=cfg, family=family)
    return input_ids, refs


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout_name", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHS)
def test_layout_matches_transformers(arch, layout_name, device, tiny_ckpts, reference):
    """On CPU with gloo; marked ``gpu``, the same on CUDA with NCCL (one GPU per rank)."""
    input_ids, refs = reference
    ref = refs[arch]
    layout, world, overrides = LAYOUTS[layout_name]
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"{layout_name} needs {world} GPUs, {torch.cuda.device_count()} visible")
    results = run_ranks(
        parity, world, str(tiny_ckpts[arch][1]), layout, input_ids, overrides, use_cuda=device == "cuda"
    )

    last_stage = [r for r in results if r["logits"] is not None]
    assert last_stage, "no rank produced logits"
    for r in last_stage:
        assert (r["logits"] - ref["logits"]).abs().max().item() <= 1e-4
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5)
        # Replaying the recorded routing reproduces the logits exactly; other experts change them.
        assert r["replay_exact"]
        assert r["forced_changes"] > 1e-3

    moe_layers = sum(ref["family"].moe_layer_pattern(ref["cfg"]))
    if layout.pp == 1:
        assert all(r["routers"] == moe_layers for r in results)
    else:
        # Each stage replays only its own routers; together they cover every MoE layer.
        assert results[0]["routers"] + results[-1]["routers"] == moe_layers
        assert 0 < results[0]["routers"] < moe_layers

    grads = results[0]["grads"]
    assert set(grads) == set(ref["grads"])
    for name, expected in ref["grads"].items():
        diff = (grads[name] - expected).norm().item()
        scale = expected.norm().item()
        assert diff <= 1e-5 * scale + 1e-9, f"{name}: |diff| {diff:.3e} vs |grad| {scale:.3e}"
