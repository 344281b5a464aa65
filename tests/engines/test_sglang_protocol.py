"""The SGLang side of the engine contract, without a server.

The driver's lifecycle runs against embedded-engine processes standing in for SGLang servers. Where SGLang is
installed (its own interpreter, :func:`moerl.engines.sglang.server_python`), the driver's flags are parsed by SGLang's
own argument parser, every body moerl's client sends is validated by SGLang's request types and its /generate contract
gate, a tensor payload is read by SGLang's unpickler and bucket, and the routing/mask codecs are checked against
SGLang's encoder and decoder: all in one run of tests/engines/sglang_side.py there. tests/sglang/ runs SGLang servers
themselves.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import stat
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moerl.engines.client import EngineClient, Returns
from moerl.engines.pool import EnginePool, EnginePoolConfig, router_args, server_args
from moerl.engines.protocol import (
    GenerateReqInput,
    ProtocolError,
    decode_routed_experts,
    decode_sampling_masks,
    encode_routed_experts,
)
from moerl.engines.sglang import CPU_KV_TOKENS
from moerl.models import ModelShape
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import ask_sglang


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A MoE policy, a dense one (a generative judge) and a reward model, as HF directories (their configs decide
    flags)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "moe": save_tiny_hf("Qwen3MoeForCausalLM", root / "moe", mlp_only_layers=[]),
        "classifier": save_tiny_hf("Qwen3ForSequenceClassification", root / "rm"),
    }


@pytest.mark.e2e
def test_server_args_carry_the_rl_flags(models):
    moe = str(models["moe"])
    cfg = EnginePoolConfig(model_path=moe, replicas=2, gpus_per_replica=4, base_port=31000)
    args = server_args(cfg, port=31001)
    assert _flag_value(args, "--port") == "31001" and _flag_value(args, "--tp-size") == "4"
    assert "--enable-return-routed-experts" in args and "--enable-memory-saver" in args
    assert _flag_value(args, "--sampling-mask-max-tokens") == str(cfg.sampling_mask_max_tokens)
    assert "--enable-lora" not in args and "--is-embedding" not in args and "--device" not in args

    with pytest.raises(ValueError, match="target modules"):
        server_args(EnginePoolConfig(model_path=moe, lora_max_rank=16), port=30000)
    lora = server_args(
        EnginePoolConfig(
            model_path=moe, lora_max_rank=16, lora_target_modules=["o_proj", "q_proj"], enable_memory_saver=False
        ),
        port=30000,
    )
    assert lora[lora.index("--lora-target-modules") + 1 : lora.index("--lora-target-modules") + 3] == [
        "o_proj",
        "q_proj",
    ]
    assert _flag_value(lora, "--max-lora-rank") == "16" and _flag_value(lora, "--lora-backend") == "triton_v2"
    assert (
        _flag_value(lora, "--moe-a2a-backend") == "none" and _flag_value(lora, "--moe-runner-backend") == "lora_triton"
    )
    assert "--enable-memory-saver" not in lora

    # On the CPU: SGLang's CPU engine, a bounded KV cache, no memory saver (it needs libcuda: the scheduler dies).
    cpu = server_args(cfg, port=31001, cuda=False)
    assert _flag_value(cpu, "--device") == "cpu" and _flag_value(cpu, "--attention-backend") == "torch_native"
    assert _flag_value(cpu, "--max-total-tokens") == str(CPU_KV_TOKENS) and "--sleep-on-idle" in cpu
    assert "--enable-memory-saver" not in cpu
    sized = server_args(EnginePoolConfig(model_path=moe, kv_tokens=512), port=1, cuda=False)
    assert _flag_value(sized, "--max-total-tokens") == "512"
    assert (
        _flag_value(server_args(EnginePoolConfig(model_path=moe, kv_tokens=512), port=1), "--max-total-tokens") == "512"
    )

    # A reward model is served at /classify; with no experts it has no routing to return (SGLang's capturer would fail
    # at start).
    rm = server_args(EnginePoolConfig(model_path=str(models["classifier"])), port=1)
    assert "--is-embedding" in rm and "--enable-return-routed-experts" not in rm
    assert "--sampling-mask-max-tokens" not in rm

    pool = EnginePool(cfg, python=sys.executable)
    assert pool.replica_urls == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    router = router_args(cfg, pool.replica_urls)
    assert router[router.index("--worker-urls") + 1 : router.index("--host")] == pool.replica_urls


@pytest.mark.e2e
def test_replicas_get_disjoint_visible_gpus(monkeypatch):
    monkeypatch.setattr("moerl.engines.pool._has_cuda", lambda: True)
    pool = EnginePool(EnginePoolConfig(model_path="/m", replicas=2, gpus_per_replica=2), python=sys.executable)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [pool._gpus(i) for i in range(2)] == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(RuntimeError, match="need 4 GPUs; 3 visible"):
        pool._gpus(0)
    # Without CUDA_VISIBLE_DEVICES, the node's GPUs: 8 trainer ranks leave no room for an engine on an 8-GPU node.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("moerl.engines.pool._gpu_count", lambda: 8)
    after_trainer = EnginePool(
        EnginePoolConfig(model_path="/m", replicas=1, gpus_per_replica=2, gpu_offset=8), python=sys.executable
    )
    with pytest.raises(RuntimeError, match="need 10 GPUs; 8 visible"):
        after_trainer._gpus(0)
    wider = EnginePool(EnginePoolConfig(model_path="/m", replicas=2, gpus_per_replica=2, gpu_offset=4), sys.executable)
    assert wider._gpus(1) == "6,7"


def _stand_in_python(tmp_path):
    """An interpreter path for EnginePool that starts ``moerl serve`` where it is asked for
    ``-m sglang.launch_server``, so the pool's real start/health/stop path runs on CPU. On a port another process
    holds it does as SGLang's server does: logs uvicorn's error and stays up, serving nothing."""
    script = tmp_path / "python-standin"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, socket, sys, time\n"
        "args = sys.argv[1:]\n"
        "assert args[:2] == ['-m', 'sglang.launch_server'], args\n"
        "model, port = args[args.index('--model-path') + 1], args[args.index('--port') + 1]\n"
        "try:\n"
        "    socket.create_server(('127.0.0.1', int(port))).close()\n"
        "except OSError as e:\n"
        "    print(f'ERROR: [Errno {e.errno}] error while attempting to bind on address (127.0.0.1, {port}): '\n"
        "          'address already in use', flush=True)\n"
        "    time.sleep(3600)\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'moerl.cli', 'serve', '--model', model, '--port', port])\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.e2e
def test_pool_starts_replicas_serves_and_stops(tmp_path, monkeypatch):
    """Replica 0 is first given a port another process holds: its server fails to bind and stays up, as SGLang's
    does; it is ended and started again elsewhere."""
    import socket

    import moerl.engines.pool as pool_module
    from moerl.env import free_ports

    model = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "model")
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    first = iter([True])

    def taken_first(n, avoid=()):
        return [taken, *free_ports(n - 1, avoid=[*avoid, taken])] if next(first, False) else free_ports(n, avoid)

    monkeypatch.setattr(pool_module, "free_ports", taken_first)
    cfg = EnginePoolConfig(model_path=str(model), replicas=2, base_port=0, log_dir=str(tmp_path / "logs"))
    pool = EnginePool(cfg, python=_stand_in_python(tmp_path))

    async def generate_on_both(urls):
        async with EngineClient(urls) as client:
            params = {"max_new_tokens": 3, "temperature": 0.0}
            outs = await asyncio.gather(*(client.generate([5, 6, 7], params) for _ in range(4)))
            return [o[0].output_ids for o in outs], await client.weight_versions()

    spawned: list = []
    popen = EnginePool._popen
    monkeypatch.setattr(EnginePool, "_popen", staticmethod(lambda *a: spawned.append(popen(*a)) or spawned[-1]))
    with squatter, pool:
        procs = list(pool.procs)
        # three servers started: replica 0's first, up but unable to serve, ended (SIGKILL)
        assert len(spawned) == 3 and spawned[0] not in procs and spawned[0].returncode == -signal.SIGKILL
        outputs, versions = asyncio.run(generate_on_both(pool.urls))
        assert pool.exited() == []
        pool.kill(pool.urls[1:])
        procs[1].wait(timeout=30)
        # the replica gone named, with its exit and the end of its log
        [gone] = pool.exited()
        assert gone.startswith(f"engine 1 ({pool.urls[1]}) exited with -9; the end of {tmp_path / 'logs'}/sglang-1.log")
        assert gone.endswith((tmp_path / "logs" / "sglang-1.log").read_text()[-500:])
    assert taken not in pool.ports and len(set(pool.ports)) == 2
    assert (
        "address already in use" in (tmp_path / "logs" / "sglang-0.log").read_text().lower()
    )  # the failed attempt's log is kept
    assert pool.urls == [f"http://127.0.0.1:{port}" for port in pool.ports]
    assert all(np.array_equal(o, outputs[0]) and len(o) == 3 for o in outputs)
    assert len(versions) == 2
    assert all(p.poll() is not None for p in procs) and pool.procs == []


def test_ports_picked_together_are_distinct_and_avoid_those_handed_out():
    """Ports picked one at a time, each closed before the next, can repeat: 48 replicas once got one port twice."""
    from moerl.env import free_ports

    handed_out = free_ports(8)
    more = free_ports(200, avoid=handed_out)
    assert len(set(handed_out)) == 8 and len(set(more)) == 200 and not set(more) & set(handed_out)


@pytest.mark.e2e
def test_pool_reports_a_server_that_dies_during_startup(tmp_path):
    """A model directory with a config and no weights: the server exits while loading it."""
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text(
        (save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "model") / "config.json").read_text()
    )
    cfg = EnginePoolConfig(model_path=str(tmp_path / "no-weights"), log_dir=str(tmp_path / "logs"))
    pool = EnginePool(cfg, python=_stand_in_python(tmp_path))
    with pytest.raises(RuntimeError, match="exited during start-up"):
        pool.start(timeout_s=60)
    assert pool.procs == []


@pytest.mark.e2e
def test_pool_fails_at_once_where_the_port_it_was_given_is_taken(tmp_path):
    """A pool given its ports (base_port: ``moerl engines --base-port``): one another process holds is no reason to pick
    another, nor to wait for a server that cannot serve (SGLang's stays up): one error naming the port, its server
    ended."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as squatter:
        port = squatter.getsockname()[1]
        model = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "model")
        cfg = EnginePoolConfig(model_path=str(model), base_port=port, log_dir=str(tmp_path / "logs"))
        pool = EnginePool(cfg, python=_stand_in_python(tmp_path))
        with pytest.raises(RuntimeError, match=rf"(?s)found its address taken \(port {port}\).*address already in use"):
            pool.start(timeout_s=600)
    assert pool.procs == []


# ---- against SGLang's own code, in its interpreter --------------------------------------------------

ROUTING = np.random.default_rng(0).integers(0, 60, size=(7, 3, 4), dtype=np.int32)
KEPT = [np.random.default_rng(k).choice(1000, size=k, replace=False).astype(np.int32) for k in (1, 5, 3, 8)]
CONTRACT_BODIES = [
    {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "top_k": 5}, "return_sampling_mask": True},
    {"input_ids": [1, 2], "sampling_params": {"top_kk": 5}},
    {"input_ids": "12"},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}},
    {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
    {"input_ids": [1], "return_logprob": "yes"},
    {"input_ids": [1], "sampling_params": {"stop_token_ids": "3"}},
]
# The routes with a body, each checked against SGLang's request type of the route (tests/engines/sglang_side.py)
SGLANG_TYPED = (
    "/generate",
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/update_weight_version",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_distributed",
    "/load_lora_adapter",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/update_weights_from_tensor",
    "/classify",
)
BUCKET = [("a", torch.randn(3, 4)), ("b", torch.arange(5)), ("c", torch.randn(2, 2).bfloat16())]
LORA_SERVER = EnginePoolConfig(
    model_path="", gpus_per_replica=2, lora_max_rank=8, lora_target_modules=["down_proj", "gate_proj", "q_proj"]
)


@pytest.fixture(scope="module")
def sglang_read(sglang_python, models):
    """What SGLang's own code makes of moerl's flags, bodies, codecs and tensor payload: one run of
    tests/engines/sglang_side.py in SGLang's interpreter (its imports take seconds)."""
    from dataclasses import replace

    from moerl.engines import tensor_ipc

    strategy = torch.multiprocessing.get_sharing_strategy()
    payload = tensor_ipc.serialize(tensor_ipc.flattened_bucket(BUCKET))  # held here while SGLang reads it
    asked = {
        "server_args": {"args": server_args(replace(LORA_SERVER, model_path=str(models["moe"])), port=30000)},
        "bodies": {"sent": [(route, body) for route, body in _captured_bodies() if route in SGLANG_TYPED]},
        "contract": {"generate_bodies": CONTRACT_BODIES},
        "codecs": {
            "routing": ROUTING.tolist(),
            "kept": [k.tolist() for k in KEPT],
            "ours": encode_routed_experts(ROUTING),
        },
        "tensor": {"payload": payload},
    }
    found = ask_sglang(sglang_python, asked, models["moe"].parent)
    assert torch.multiprocessing.get_sharing_strategy() == strategy, "tensor_ipc restores the strategy it changed"
    return found


@pytest.mark.sglang
def test_server_args_parse_with_sglangs_parser(sglang_read):
    ns = sglang_read["server_args"]
    assert ns["lora_target_modules"] == ["down_proj", "gate_proj", "q_proj"]
    assert ns["enable_return_routed_experts"] and ns["enable_memory_saver"] and ns["enable_lora"]
    assert (
        ns["tp_size"],
        ns["max_lora_rank"],
        ns["lora_backend"],
        ns["moe_a2a_backend"],
        ns["moe_runner_backend"],
    ) == (
        2,
        8,
        "triton_v2",
        "none",
        "lora_triton",
    )
    assert ns["sampling_mask_max_tokens"] == EnginePoolConfig.sampling_mask_max_tokens


def _captured_bodies() -> list[tuple[str, dict]]:
    """Every route and body moerl's client sends, captured at the transport."""
    sent: list[tuple[str, dict]] = []

    class Capturing(EngineClient):
        async def _call(self, url, route, request=None, retries=None, parse=None):
            sent.append((route.path, request.body() if request is not None else None))
            if route.path == "/generate":
                answer = {
                    "output_ids": [1],
                    "meta_info": {
                        "id": "r",
                        "prompt_tokens": 2,
                        "finish_reason": {"type": "length"},
                        "routed_experts": encode_routed_experts(np.zeros((2, 2, 2), np.int32)),
                        "output_token_sampling_mask": [[1]],
                        "input_token_logprobs": [[None, 1, None], [-0.5, 2, None]],
                    },
                }
                return await parse(json.dumps(answer).encode()) if parse is not None else answer
            if route.path == "/classify":
                return [{"embedding": [0.5], "meta_info": {"id": None, "prompt_tokens": 2}}]
            return {"weight_version": "0"}

    async def run():
        client = Capturing(["http://x"], shape=ModelShape(2, 2, [0, 1], 4))
        await client.generate(
            [1, 2],
            {"max_new_tokens": 1, "top_k": 5, "n": 1},
            Returns(routing_from=1, sampling_mask=True),
            rid="r",
            lora_path="a",
        )
        await client.generate(  # n > 1 with kept sets: a prefill, then one request a completion
            [1, 2], {"max_new_tokens": 1, "top_k": 5, "n": 2}, Returns(sampling_mask=True), rid="g", extra_key="k"
        )
        await client.generate(
            [1, 2], {"temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "stop_token_ids": [3], "ignore_eos": False}
        )
        await client.token_logprobs([1, 2], 1, top=2)
        await client.pause("in_place")
        await client.resume()
        await client.abort("r")
        await client.abort()
        await client.weight_versions()
        await client.set_weight_version("7")
        await client.update_weights_from_disk("/ckpt", weight_version="3")
        await client.init_weights_update_group("127.0.0.1", 29500, 2, "g", "nccl")
        await client.begin_weight_update()
        await client.update_weights_from_distributed(
            ["w"], ["bfloat16"], [[2, 2]], "g", weight_version="4", load_format="flattened_bucket"
        )
        await client.end_weight_update()
        await client.load_lora("a", "/adapters/a")
        await client.load_lora_from_tensors("t", {"r": 2}, {"w": torch.ones(2)})
        await client.unload_lora("a")
        await client.classify_on("http://x", [[1, 2]])
        await client.release_memory()
        await client.resume_memory(["weights"])
        await client.update_weights_from_tensor(
            lambda url: [base64.b64encode(b"payload").decode()] * 2,
            "flattened_bucket",
            weight_version="5",
            flush_cache=False,
        )

    asyncio.run(run())
    return sent


def test_n_completions_with_kept_sets_go_as_sglang_sends_its_own():
    """SGLang 0.5.23 fails every n > 1 request with kept sets (its prefill-only warm-up asks for a kept set it cannot
    capture): the client sends the prefill, asking for nothing back, then one request per completion."""
    bodies = [body for route, body in _captured_bodies() if route == "/generate"]
    prefill, *each = [body for body in bodies if body.get("rid", "").startswith("g")]
    assert prefill == {
        "input_ids": [1, 2],
        "sampling_params": {"max_new_tokens": 0, "top_k": 5, "n": 1},
        "rid": "g-prefill",
        "extra_key": "k",
    }
    assert [b["rid"] for b in each] == ["g-0", "g-1"]
    assert all(b["sampling_params"]["n"] == 1 and b["return_sampling_mask"] and b["extra_key"] == "k" for b in each)
    assert not any(b["sampling_params"].get("n", 1) > 1 and b.get("return_sampling_mask") for b in bodies)


@pytest.mark.sglang
def test_client_bodies_validate_against_sglangs_request_types(sglang_read):
    """SGLang drops fields it does not know silently, so a misspelled one would be lost: names are checked too."""
    assert {route for route, _ in _captured_bodies()} == set(SGLANG_TYPED) | {"/model_info"}
    assert sglang_read["bodies"] == []


@pytest.mark.sglang
def test_a_tensor_payload_is_read_by_sglangs_unpickler_and_bucket(sglang_read):
    """What moerl hands SGLang's /update_weights_from_tensor passes its restricted unpickler, and its weight updater's
    reading of the metadata rebuilds every tensor."""
    read = sglang_read["tensor"]
    assert [name for name, _, _ in read] == [name for name, _ in BUCKET]
    for (_, dtype, values), (_, tensor) in zip(read, BUCKET, strict=True):
        assert dtype == str(tensor.dtype) and values == tensor.float().flatten().tolist()


@pytest.mark.sglang
def test_generate_bodies_sglangs_contract_refuses_are_refused_here(sglang_read):
    for body, theirs in zip(CONTRACT_BODIES, sglang_read["contract"], strict=True):
        if theirs is None:
            GenerateReqInput.parse(body)
        else:
            with pytest.raises(ProtocolError):
                GenerateReqInput.parse(body)


@pytest.mark.sglang
def test_routing_and_mask_codecs_match_sglangs(sglang_read):
    codecs = sglang_read["codecs"]
    assert np.array_equal(decode_routed_experts(codecs["encoded"], 3, 4, [0, 2], 60), ROUTING[:, [0, 2]])
    assert codecs["decoded"] == ROUTING.ravel().tolist()
    offsets, ids = decode_sampling_masks(codecs["masks"])
    assert offsets.tolist() == [0, 1, 6, 9, 17]
    assert all(np.array_equal(ids[offsets[t] : offsets[t + 1]], KEPT[t]) for t in range(len(KEPT)))


def test_models_sglang_would_serve_wrong_are_named_before_launch(tmp_path, monkeypatch):
    """SGLang 0.5.23 builds every Qwen MoE layer sparse and never ties the output layer (its routing and log-probs were
    compared with transformers'), and gives a sequence classifier's head a bias transformers' lacks: such a model is
    refused before launch, with what to do, whoever serves it; one it serves faithfully is not."""
    from moerl.engines.sglang import served_wrong
    from moerl.errors import ConfigError
    from moerl.orchestrator import preflight
    from moerl.orchestrator.config import load_config

    assert served_wrong(save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "sparse", mlp_only_layers=[])) is None
    assert "mlp_only_layers=[1]" in served_wrong(save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "dense"))
    assert "decoder_sparse_step=2" in served_wrong(save_tiny_hf("Qwen2MoeForCausalLM", tmp_path / "qwen2"))
    tied = save_tiny_hf("Qwen2MoeForCausalLM", tmp_path / "tied", decoder_sparse_step=1)
    assert "tie_word_embeddings" in served_wrong(tied)
    untied = save_tiny_hf("Qwen2MoeForCausalLM", tmp_path / "untied", decoder_sparse_step=1, tie_word_embeddings=False)
    assert served_wrong(untied) is None
    scored = save_tiny_hf("Qwen3ForSequenceClassification", tmp_path / "rm")  # saved with a zero score.bias
    assert served_wrong(scored) is None
    unbiased = tmp_path / "rm-hf"
    from transformers import AutoModelForSequenceClassification

    AutoModelForSequenceClassification.from_pretrained(scored).save_pretrained(unbiased)  # transformers' own save
    assert "score.bias" in served_wrong(unbiased)

    monkeypatch.setattr("moerl.engines.sglang.sglang_problem", lambda installed=None: None)
    dense = tmp_path / "dense"
    for overrides, named in (
        ([f"model.path={dense}", "engines.server=sglang"], "model.path: "),
        ([f"reward.model={unbiased}", "reward.engines.server=sglang"], "reward.model: "),
    ):
        with pytest.raises(ConfigError, match=named) as refused:
            preflight.preflight(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]), 2)
        assert "served_wrong" not in str(refused.value) and "engines.server=embedded" in str(refused.value)
    with pytest.raises(ConfigError, match="Intel AMX kernels") as refused:  # SGLang's CPU FP8: not on this machine kind
        preflight.preflight(
            load_config(None, [f"run.dir={tmp_path / 'run'}", "engines.server=sglang", "engines.quantization=fp8"]), 2
        )
    assert "engines.server=embedded" in str(refused.value)
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"architectures": ["MistralForSequenceClassification"]}))
    with pytest.raises(ConfigError, match="MistralForSequenceClassification is not among the sequence classifiers"):
        preflight.check_reward(load_config(None, [f"reward.model={mistral}"]))
