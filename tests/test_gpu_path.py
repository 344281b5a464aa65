"""The GPU path's logic, exercised on the CPU: which device and process group, which names Transformer
Engine's spec gives, which ranks engines take, what is retried, what is flushed, what fits in memory."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import torch
import torch.distributed as dist

from moerl.errors import ConfigError
from moerl.megatron.launch import run_ranks
from moerl.models.tiny import save_tiny_hf
from tests import DATA, REPO
from tests.workers import te_norm_names

QWEN3_30B = DATA / "qwen3_30b_a3b"


def test_the_unmarked_suite_runs_on_the_cpu():
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "" and not torch.cuda.is_available()


# ---- 1, 2: one process group, on this rank's GPU; collectives on the collective's device ---------------
def test_the_process_group_is_made_after_the_device_is_chosen(monkeypatch):
    from moerl.megatron import parallel

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(("init", backend, sorted(kw))))
    monkeypatch.setenv("LOCAL_RANK", "3")
    parallel.init_process_group()
    # no device_id: the weight group is no split of it
    assert calls == [("set_device", 3), ("init", "nccl", ["timeout"])]


def test_only_one_place_creates_the_process_group():
    callers = [
        p.relative_to(REPO).as_posix()
        for p in (REPO / "moerl").rglob("*.py")
        if "dist.init_process_group(" in p.read_text()
    ]
    assert callers == ["moerl/megatron/parallel.py"]


def test_collectives_take_tensors_on_this_ranks_gpu_under_nccl(monkeypatch):
    from moerl.megatron.parallel import collective_device

    assert collective_device() == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert collective_device() == torch.device("cuda", 5)


# ---- 3: conversion is CPU-only, also where CUDA is visible ------------------------------------------------
def test_conversion_on_a_cuda_host_runs_on_the_cpu(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from moerl.checkpoint import convert
    from moerl.checkpoint.hf import CheckpointError

    hf = save_tiny_hf("Qwen2MoeForCausalLM", tmp_path / "hf")
    # As on a GPU box: the conversion runs in a fresh process that sees no GPU (in this one it would .cuda()).
    monkeypatch.setattr(convert.torch.cuda, "is_available", lambda: True)
    mcore = convert.hf_to_mcore(hf, tmp_path / "mcore", progress=False)
    back = convert.mcore_to_hf(mcore, tmp_path / "back", progress=False)
    original, round_trip = load_file(hf / "model.safetensors"), {}
    for shard in back.glob("*.safetensors"):
        round_trip.update(load_file(shard))
    assert original.keys() - {"lm_head.weight"} == round_trip.keys() and all(
        torch.equal(original[k], round_trip[k]) for k in round_trip
    )
    with pytest.raises(
        CheckpointError, match="already exists"
    ):  # a user's mistake comes back as itself, not a traceback
        convert.hf_to_mcore(hf, tmp_path / "mcore", progress=False)


@pytest.mark.e2e
def test_cpu_ranks_are_started_without_a_gpu_in_view(monkeypatch):
    """A spawned rank imports megatron-core while unpickling its function, before any of its code runs, and torch
    remembers what CUDA it saw then: on an H100, the conversion's meta model was .cuda()'d. The variable must be in
    the environment the rank starts with, and the launching process keeps its own."""
    from tests.workers import cuda_visible_at_start

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_ranks(cuda_visible_at_start, 1, use_cuda=False) == [""]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"


# ---- 4: Transformer Engine's names ------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"])
def test_norms_are_checkpointed_and_exported_under_transformer_engines_names(arch):
    """megatron-core's own TE layer spec (with stand-in TE classes) says where TE keeps each norm; the local
    spec must checkpoint every norm under that name, and weight export must map TE's names to the Hub's."""
    result = run_ranks(te_norm_names, 1, arch)[0]
    assert result["te_names"] == result["local_keys"], result["te_names"] ^ result["local_keys"]
    assert result["exported"] == result["rule_names"]
    dense = [i for i, moe in enumerate(result["pattern"]) if not moe]
    # fused in dense layers
    assert dense and any(f"layers.{dense[0]}.mlp.linear_fc1.layer_norm_weight" in n for n in result["te_names"])
    moe = result["pattern"].index(1)
    assert f"decoder.layers.{moe}.pre_mlp_layernorm.weight" in result["te_names"]  # kept apart in MoE layers


def test_a_checkpoint_in_the_previous_format_still_loads(tmp_path, monkeypatch):
    from moerl.checkpoint import convert, mcore
    from moerl.checkpoint.verify import verify
    from moerl.models import qwen_moe

    hf = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "hf")
    with monkeypatch.context() as m:  # format 1 kept a MoE layer's pre-MLP norm under the fused name
        m.setattr(qwen_moe, "_checkpoint_keys_as_te", lambda block: block)
        old = convert.hf_to_mcore(hf, tmp_path / "old", progress=False)
    meta = json.loads((old / mcore.MOERL_META).read_text())
    (old / mcore.MOERL_META).write_text(json.dumps({**meta, "format_version": 1}))
    assert verify(hf, old) < 1e-4


# ---- Transformer Engine's fusions -----------------------------------------------------------------------
FUSIONS = ("apply_rope_fusion", "moe_permute_fusion", "gradient_accumulation_fusion")


@pytest.mark.parametrize("apex", [True, False], ids=["apex", "no-apex"])
def test_transformer_engines_fusions_are_on_where_it_builds_the_model(monkeypatch, apex):
    """Where TE builds the model its fused RoPE and MoE permutation are on, and, for the trainer's model
    (megatron-core's DDP gives its weights main_grad buffers), fused gradient accumulation where Apex's kernel is
    there for the output layer, which megatron-core builds from its own linear layer. Local layers (no TE, or
    LoRA's) keep all three off. TE is stood in for by the kernels megatron-core's config looks for: the config is
    its own, validated."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel import layers as tp_layers

    from moerl.layout import Layout
    from moerl.megatron.model import model_config
    from moerl.models import qwen_moe
    from moerl.models.tiny import TINY_QWEN3

    monkeypatch.setattr(qwen_moe, "te_usable", lambda: True)
    for name in (
        "fused_permute",
        "fused_permute_with_probs",
        "fused_sort_chunks_by_index",
        "fused_sort_chunks_by_index_with_probs",
        "fused_unpermute",
    ):
        monkeypatch.setattr(moe_utils, name, object(), raising=False)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object())
    monkeypatch.setattr(tp_layers, "_grad_accum_fusion_available", apex)
    cfg = dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"])

    def fused(**kwargs) -> dict:
        config = model_config(cfg, Layout(), **kwargs)
        assert config.moe_enable_routing_replay and not config.moe_router_fusion  # replay as moerl needs it
        return {name: getattr(config, name) for name in FUSIONS}

    on = {"apply_rope_fusion": True, "moe_permute_fusion": True}
    assert fused(ddp_main_grads=True) == {**on, "gradient_accumulation_fusion": apex}
    assert fused() == {**on, "gradient_accumulation_fusion": False}
    off = dict.fromkeys(FUSIONS, False)
    assert fused(transformer_engine=False, ddp_main_grads=True) == off
    monkeypatch.setattr(qwen_moe, "te_usable", lambda: False)
    assert fused(ddp_main_grads=True) == off


# ---- 6: weight-group ranks of tensor-parallel engines -------------------------------------------------
def test_engines_take_as_many_group_ranks_as_their_tensor_parallel_size(monkeypatch):
    from moerl.engines.client import EngineClient
    from moerl.weight_sync import broadcast
    from moerl.weight_sync.broadcast import group_ranks

    assert group_ranks([1, 1]) == ([1, 2], 3)
    assert group_ranks([2, 2, 4]) == ([1, 3, 5], 9)
    joined = {}

    async def server_info(self):
        return [{"tp_size": 2}, {"tp_size": 2}]

    async def init(self, address, port, world, name, backend, rank_offsets=None):
        joined.update(world=world, offsets=rank_offsets)

    monkeypatch.setattr(EngineClient, "server_info", server_info)
    monkeypatch.setattr(EngineClient, "init_weights_update_group", init)
    monkeypatch.setattr(broadcast, "join_weight_group", lambda backend, store, world, rank, name: ("group", world))
    abandoned = []
    monkeypatch.setattr(broadcast, "abandon_weight_group", abandoned.append)
    sync = broadcast.BroadcastSync(["http://a", "http://b"], "127.0.0.1", "gloo")
    try:
        sync.connect()
        assert joined == {"world": 5, "offsets": [1, 3]} and sync.group == ("group", 5)
    finally:
        sync.close()
    assert abandoned == [("group", 5)] and sync.group is None


# ---- 7: LoRA in a bf16 engine --------------------------------------------------------------------------
def test_a_bf16_engine_applies_adapters_unmerged_in_fp32_on_the_models_device(tmp_path):
    """Merging an update into bf16 weights rounds it at the weights' resolution (and added a CPU delta to a
    CUDA weight); the adapter is applied instead to each layer's output from fp32 factors on the model's device,
    as the trainer applies it, and the bf16 base weight is never written."""
    from safetensors.torch import save_file

    from moerl.engines.embedded.engine import EmbeddedEngine

    hf = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "hf")
    config = json.loads((hf / "config.json").read_text())
    h, out = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, h, generator=g) * 1e-2,
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(out, 2, generator=g) * 1e-2,
        },
        str(adapter / "adapter_model.safetensors"),
    )
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    engine = EmbeddedEngine(str(hf), dtype=torch.bfloat16, device="cpu")
    q_proj = engine.runner.model.get_submodule("model.layers.0.self_attn.q_proj")
    base_weight = q_proj.weight.detach().clone()
    engine.adapters.add(engine.adapters.from_dir("small", adapter))
    a, b = engine.adapters.adapters["small"].linear["model.layers.0.self_attn.q_proj"]
    assert a.dtype == b.dtype == torch.float32 and a.device == b.device == q_proj.weight.device
    x = torch.randn(5, h, generator=g).to(torch.bfloat16)
    with torch.no_grad():
        plain = q_proj(x)
        engine.adapters.activate("small")
        adapted = q_proj(x)
        engine.adapters.activate(None)
    expected = plain + (2.0 * torch.nn.functional.linear(torch.nn.functional.linear(x.float(), a), b)).to(
        torch.bfloat16
    )
    assert torch.equal(adapted, expected) and not torch.equal(adapted, plain)
    assert torch.equal(q_proj.weight, base_weight)


# ---- 8: only idempotent routes are retried ------------------------------------------------------------
def test_joins_broadcasts_and_loads_are_never_retried():
    from aiohttp import web

    from moerl.engines.client import EngineClient, EngineError
    from tests.engine_server import serving

    hits = {}

    async def failing(request):
        hits[request.path] = hits.get(request.path, 0) + 1
        return web.json_response({"error": {"message": "busy"}}, status=503)

    async def go():
        async with (
            serving({("*", "/{tail:.*}"): failing}) as url,
            EngineClient([url], retries=2, backoff_s=0.01) as client,
        ):
            for call in (
                client.weight_versions(),
                client.init_weights_update_group("127.0.0.1", 1, 2, "g", "gloo"),
                client.update_weights_from_distributed(["w"], ["float32"], [[1]], "g"),
                client.load_lora("a", "/x"),
                client.update_weights_from_disk("/x"),
            ):
                with pytest.raises(EngineError, match="503"):
                    await call

    asyncio.run(go())
    assert hits == {
        "/model_info": 3,
        "/init_weights_update_group": 1,
        "/update_weights_from_distributed": 1,
        "/load_lora_adapter": 1,
        "/update_weights_from_disk": 1,
    }


# ---- 9: SGLang present and recent enough, or said why not ---------------------------------------------
def test_sglang_is_used_only_when_it_is_installed_and_recent(monkeypatch, tmp_path):
    from moerl.engines import sglang
    from moerl.orchestrator.config import EngineSection, served_by

    versions: dict[str, str] = {}  # interpreter -> the sglang installed for it
    monkeypatch.setattr(sglang, "_version_in", versions.get)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MOERL_SGLANG_VENV", str(tmp_path / "venv"))
    monkeypatch.delenv("MOERL_SGLANG_PYTHON", raising=False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # none beside moerl either
    assert sglang.server_python() is None
    assert "not installed" in sglang.sglang_problem() and served_by(EngineSection()) == "embedded"
    python = tmp_path / "venv" / "bin" / "python"  # the environment tools/install.sh sglang makes
    python.parent.mkdir(parents=True)
    python.touch()
    assert sglang.server_python() == str(python)
    assert f"not installed for {python}" in sglang.sglang_problem()
    versions[str(python)] = "0.5.10"
    assert "0.5.10 is older than 0.5.23" in sglang.sglang_problem() and served_by(EngineSection()) == "embedded"
    versions[str(python)] = "0.5.23"
    assert sglang.sglang_problem() is None and served_by(EngineSection()) == "sglang"
    monkeypatch.setenv("MOERL_SGLANG_PYTHON", "/elsewhere/python")  # given: it wins
    assert sglang.server_python() == "/elsewhere/python" and "not installed" in sglang.sglang_problem()
    assert sglang.sglang_problem("0.4.9") and sglang.sglang_problem("0.6.0") is None  # a running server's version


@pytest.mark.e2e
def test_an_explicit_sglang_without_sglang_is_one_error_line(tmp_path):
    import subprocess
    import sys

    from moerl.env import child_env

    out = subprocess.run(
        [
            "bash",
            str(REPO / "recipes" / "qwen_moe_grpo.sh"),
            "engines.server=sglang",
            f"run.dir={tmp_path}/r",
            f"run.cache_dir={tmp_path}/c",
        ],
        # an SGLang environment where none is installed
        env={**child_env(PYTHON=sys.executable, MOERL_SGLANG_VENV=str(tmp_path / "none")), "MOERL_SGLANG_PYTHON": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith(
        "error: engines.server=sglang: sglang is not installed"
    )


# ---- 13: the trainer's memory ------------------------------------------------------------------------
@pytest.mark.e2e
def test_the_output_layer_computes_logits_in_fp32_from_bf16_weights():
    result = run_ranks(bf16_output_layer, 1)[0]
    assert result["dtype"] == torch.float32
    assert torch.equal(result["logits"], result["expected"])  # the fp32 product, not bf16 logits upcast
    assert not torch.equal(result["expected"].to(torch.bfloat16).float(), result["expected"])


def bf16_output_layer() -> dict:
    from moerl.layout import Layout
    from moerl.megatron.model import build_model
    from moerl.megatron.parallel import init_distributed
    from moerl.models.tiny import TINY_QWEN3
    from moerl.trainer.trainer import _fp32_output_layer

    init_distributed(Layout())
    torch.manual_seed(0)
    model = build_model(dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"]), Layout(), torch.bfloat16)
    _fp32_output_layer(model)
    seen = {}
    model.output_layer.register_forward_pre_hook(lambda module, args: seen.update(hidden=args[0]))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids, torch.arange(4)[None], None)
        expected = seen["hidden"].float() @ model.output_layer.weight.float().t()
    return {"dtype": logits.dtype, "logits": logits[0], "expected": expected[:, 0]}


@pytest.mark.e2e
def test_the_fp32_output_layer_keeps_its_weight_gradient_unfused():
    """With gradient accumulation fused (TE and Apex), the output layer's GEMM would add its weight gradient into the
    main_grad of the weight it is given: the fp32 copy of the logits' computation has none, and the backward failed."""
    (out,) = run_ranks(fused_accumulation_output_layer, 1)
    assert out["built_fused"] and not out["fused"] and out["grad"]


def fused_accumulation_output_layer() -> dict:
    from megatron.core.tensor_parallel import layers as tp_layers

    from moerl.layout import Layout
    from moerl.megatron.model import build_model
    from moerl.megatron.parallel import init_distributed
    from moerl.models.tiny import TINY_QWEN3
    from moerl.trainer.trainer import _fp32_output_layer

    tp_layers._grad_accum_fusion_available = True  # as with Apex's kernel, which the backward below does not reach
    init_distributed(Layout())
    model = build_model(
        dict(TINY_QWEN3, architectures=["Qwen3MoeForCausalLM"]),
        Layout(),
        torch.bfloat16,
        gradient_accumulation_fusion=True,
    )
    built_fused = model.output_layer.gradient_accumulation_fusion
    _fp32_output_layer(model)
    logits, _ = model.output_layer(torch.randn(4, 1, TINY_QWEN3["hidden_size"], dtype=torch.bfloat16))
    logits.sum().backward()
    grad = model.output_layer.weight.grad
    return {
        "built_fused": built_fused,
        "fused": model.output_layer.gradient_accumulation_fusion,
        "grad": grad is not None and bool(grad.abs().sum() > 0),
    }


# ---- megatron-core without Transformer Engine or Apex on a GPU (found on an H100) -----------------------
def test_the_routers_gemm_works_without_transformer_engine_on_a_gpu_too(monkeypatch):
    """megatron-core's router_gating_linear tests a name only Transformer Engine's import binds: the first MoE
    forward on an H100 without TE raised NameError. init_distributed binds it on every device."""
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core import parallel_state

    from moerl.layout import Layout
    from moerl.megatron import parallel

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU: the CPU layer stays off
    monkeypatch.setattr(parallel, "init_process_group", lambda timeout_s: None)
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda seed: None)
    monkeypatch.setattr(parallel_state, "destroy_model_parallel", lambda: None)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kw: None)
    monkeypatch.setattr(parallel.dist, "get_world_size", lambda: 1)
    parallel.init_distributed(Layout())
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)


@pytest.mark.e2e
def test_a_fresh_optimizer_is_readied_for_a_checkpoint_load(tiny_ckpts):
    """megatron-core's DistributedOptimizer without Apex or TE reads one common Adam step of every parameter before
    it loads (a resumed run with the distributed optimizer failed there on an H100); a fresh torch Adam has none. The
    trainer gives every parameter torch's first-step state (zero moments, step 0) for the checkpoint to overwrite."""
    from moerl.trainer.config import TrainerConfig
    from tests.workers import adam_steps_before_loading

    (out,) = run_ranks(adam_steps_before_loading, 1, str(tiny_ckpts["Qwen3MoeForCausalLM"][1]), TrainerConfig())
    assert out["fresh"] == 0 and out["params"] > 0
    assert out["with_state"] == out["params"] and out["steps"] == [0.0] and out["moments_zero"]


def _one_parameter_distributed_optimizer():
    """megatron-core's DistributedOptimizer (CUDA-only to build) reduced to what its fully_reshardable loader reads: one
    parameter of 6 elements, of which this rank holds 1..5, its torch Adam state as torch's load leaves it (step 7)."""
    from types import SimpleNamespace

    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer, Range

    param, main = torch.nn.Parameter(torch.zeros(6)), torch.nn.Parameter(torch.zeros(4))
    adam = torch.optim.Adam([main])
    adam.state[main].update(step=torch.tensor(7.0), exp_avg=torch.zeros(4), exp_avg_sq=torch.zeros(4))
    opt = object.__new__(DistributedOptimizer)
    opt.optimizer, opt.config = adam, SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False)
    opt.model_param_group_index_map = {param: (0, 0)}
    opt.gbuf_ranges = [{(torch.float32, torch.float32): [{"param_map": {param: {"param": Range(1, 5)}}}]}]
    opt.buffers = [SimpleNamespace(param_index_map={param: (0, 6, 0)})]
    return opt, adam.state[main], main


def test_a_fully_reshardable_optimizer_state_loads_into_torch_adam():
    """megatron-core's loader passes each parameter's saved tensors without the Adam step (loaded before, from the
    parameter groups) to a copy that asks for every key the state holds: a resumed run failed on an H200 with
    KeyError 'step'. With the trainer's adjustment the shard's values load and the loaded step stays."""
    from moerl.trainer.trainer import _keep_loaded_adam_steps

    saved = [
        {
            "fp32_param": torch.arange(6.0),
            "exp_avg": torch.arange(6.0) + 10,
            "exp_avg_sq": torch.arange(6.0) + 20,
            "step": torch.tensor(3.0),
        }
    ]
    unadjusted, _, _ = _one_parameter_distributed_optimizer()
    with pytest.raises(KeyError, match="step"):
        unadjusted.load_parameter_state_from_fully_reshardable(saved)
    opt, state, main = _one_parameter_distributed_optimizer()
    _keep_loaded_adam_steps(opt)
    opt.load_parameter_state_from_fully_reshardable(saved)
    assert main.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert state["exp_avg"].tolist() == [11.0, 12.0, 13.0, 14.0] and state["exp_avg_sq"].tolist() == [
        21.0,
        22.0,
        23.0,
        24.0,
    ]
    assert state["step"].item() == 7.0


# ---- the memory plan ---------------------------------------------------------------------------------
def _plan(*overrides: str, config: str = "recipes/qwen3_30b_a3b.yaml", world: int | None = None):
    from moerl.orchestrator import memory
    from moerl.orchestrator.config import load_config
    from moerl.orchestrator.preflight import trainer_world_size

    cfg = load_config(REPO / config, [f"model.path={QWEN3_30B}", "engines.urls=[]", *overrides])
    return memory.plan(cfg, json.loads((QWEN3_30B / "config.json").read_text()), world or trainer_world_size(cfg), 80.0)


def test_the_plan_counts_qwen3_30b_a3b_as_published():
    from moerl.models import family_for

    config = json.loads((QWEN3_30B / "config.json").read_text())
    family = family_for(config)
    assert family.hub_numel(family.normalize(config)) == 30_532_122_624  # "30.5B in total"
    one = _plan("trainer.tp=1", "trainer.ep=1", "run.trainer_ranks=1")
    assert one.trainer.params == 30_532_122_624
    assert one.trainer.terms["weights"] == 2 * one.trainer.params  # bf16
    assert one.trainer.terms["gradients (fp32)"] == 4 * one.trainer.params
    assert one.trainer.terms["optimizer state"] == 12 * one.trainer.params  # no data parallelism to divide it


def test_the_old_30b_layout_is_refused_and_says_what_to_change():
    plan = _plan("trainer.ep=2", "run.trainer_ranks=4", "engines.gpus_per_replica=1")  # the previous recipe
    assert 15.2e9 < plan.trainer.params < 15.4e9  # experts over EP2, the rest over TP2
    (problem,) = [p for p in plan.problems if "trainer rank" in p]
    assert "the largest term is optimizer state" in problem and "distributed_optimizer" in problem
    assert "run.trainer_ranks" in problem


def test_the_30b_recipe_fits_and_its_terms_add_up():
    plan = _plan()
    assert not plan.problems, plan.problems
    terms = plan.trainer.terms
    assert terms["optimizer state"] < 12 * plan.trainer.params / 2 + 1  # experts over expert-DP 2, the rest over DP 8
    assert plan.trainer.total < 0.9 * 80 * 2**30
    lora = _plan("lora.enabled=true", "lora.rank=16", "sync.method=disk")
    # LoRA trains megatron-core's local attention: what it saves in gradients and Adam's state, its s x s scores take
    # back.
    scores = lora.trainer.terms["attention scores (s x s)"]
    assert lora.trainer.trainable < plan.trainer.params / 20 and lora.trainer.total - scores < plan.trainer.total / 2
    # The plan counts the modules lora.targets names, as add_lora adapts them: attention alone trains far less.
    attention = _plan("lora.enabled=true", "lora.rank=16", "sync.method=disk", "lora.targets=[linear_qkv,linear_proj]")
    assert 0 < attention.trainer.trainable < lora.trainer.trainable / 10


def test_the_plan_counts_the_loss_inputs_of_a_step_kept_sets_included():
    """The loss's inputs stay on a rank's device for a whole instalment (a sync step is one): at most every response of
    the step at max_new_tokens, over dense data parallelism, 73 bytes a token and 4 for each id of its kept set. At
    32K-token responses the recipe's logits need TP4 (tests/orchestrator/test_memory_plan.py), on 32 ranks to keep dense
    data parallelism 8."""
    term = "loss inputs (a step, at most)"
    tokens = 32 * 8 * 32768 / 8  # the recipe's 32 x 8 responses over 32 ranks at TP4: 8 data-parallel ranks
    layout = ("rollout.max_new_tokens=32768", "trainer.tp=4", "run.trainer_ranks=32")
    narrow = _plan(*layout)  # the recipe's top_k, 64
    assert narrow.trainer.terms[term] == tokens * (73 + 4 * 64) and not narrow.problems
    wide = _plan(*layout, "rollout.top_k=8192")
    assert wide.trainer.terms[term] == tokens * (73 + 4 * 8192)  # 32 GiB: the rank no longer fits
    assert any("a trainer rank needs" in p and "the largest term is loss inputs" in p for p in wide.problems)
    unmasked = _plan(*layout, "rollout.top_k=8192", "trainer.replay.sampling_mask=false")
    assert unmasked.trainer.terms[term] == tokens * 73 and not unmasked.problems


def test_engines_that_cannot_hold_the_model_are_refused():
    plan = _plan("engines.gpus_per_replica=1", "engines.mem_fraction_static=0.6")
    assert any("raise engines.gpus_per_replica" in p for p in plan.problems)


@pytest.mark.e2e
def test_the_job_refuses_a_plan_that_does_not_fit_before_any_preparation(tmp_path):
    import subprocess
    import sys

    from moerl.env import child_env

    out = subprocess.run(
        [
            "bash",
            str(REPO / "recipes" / "qwen_moe_grpo.sh"),
            f"model.path={QWEN3_30B}",
            "trainer.ep=1",
            "run.trainer_ranks=1",
            "rollout.max_new_tokens=64",
            "model.mcore=/nonexistent",
            f"run.dir={tmp_path}/r",
        ],
        env=child_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: memory plan: a trainer rank needs")
    assert not (tmp_path / "r").exists()


@pytest.mark.e2e
def test_the_plan_is_printed_with_show_plan():
    import subprocess
    import sys

    from moerl.env import child_env

    out = subprocess.run(
        [
            "bash",
            str(REPO / "recipes" / "qwen_moe_grpo.sh"),
            "--config",
            "recipes/qwen3_30b_a3b.yaml",
            f"model.path={QWEN3_30B}",
            "--show-plan",
        ],
        env=child_env(PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert "4,400,822,272 parameters" in out.stdout and "optimizer state" in out.stdout


def test_an_embedded_engine_on_several_gpus_is_refused():
    with pytest.raises(ConfigError, match="embedded engine serves on one device"):
        from moerl.orchestrator.config import load_config

        load_config(None, ["engines.server=embedded", "engines.gpus_per_replica=2"])


def test_sglang_servers_given_by_url_are_refused_where_the_run_could_not_use_them():
    """The config's check sees SGLang only where the job starts it; an SGLang server given by engines.urls is known once
    it answers, and a LoRA run syncing by broadcast (adapter tensors pickled per TP rank, which SGLang takes only from
    its own machine, and otherwise fails to unpickle in its scheduler) must stop there, not at its first sync."""
    from aiohttp import web

    from moerl.errors import ConfigError
    from moerl.orchestrator.config import load_config, sglang_lora_problem
    from moerl.orchestrator.preflight import check_engine_urls
    from tests.engine_server import serving

    async def health(request):
        return web.Response(text="")

    async def server_info(request):
        return web.json_response({"version": "0.5.23", "tp_size": 1})  # SGLang's answer names no moerl engine

    refused = sglang_lora_problem(load_config(None, ["lora.enabled=true", "sync.method=broadcast"]))
    assert refused and sglang_lora_problem(load_config(None, ["lora.enabled=true", "sync.method=disk"])) is None

    async def go():
        async with serving({("GET", "/health"): health, ("GET", "/server_info"): server_info}) as url:
            await asyncio.to_thread(check_engine_urls, [url])
            with pytest.raises(
                ConfigError, match="is an SGLang server, and lora.enabled with SGLang engines needs sync.method=disk"
            ):
                await asyncio.to_thread(check_engine_urls, [url], False, refused)

    asyncio.run(go())
