"""The SGLang side of the engine contract.

The driver's lifecycle runs against embedded-engine processes standing in for SGLang servers (SGLang
itself needs a GPU). Where ``sglang`` imports, the driver's flags are parsed by SGLang's own argument
parser, every body moerl's client sends is validated by SGLang's request types and its /generate
contract gate, and the routing/mask codecs are checked against SGLang's encoder and decoder.
"""

from __future__ import annotations

import asyncio
import stat
import sys

import numpy as np
import pytest
import torch

from moerl.engines.client import EngineClient
from moerl.engines.pool import EnginePool, EnginePoolConfig, router_args, server_args
from moerl.engines.protocol import (
    GenerateReqInput,
    ProtocolError,
    decode_routed_experts,
    decode_sampling_masks,
    encode_routed_experts,
)
from moerl.models import ModelShape
from moerl.models.tiny import save_tiny_hf


def _flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


@pytest.mark.e2e
def test_server_args_carry_the_rl_flags():
    cfg = EnginePoolConfig(model_path="/m", replicas=2, gpus_per_replica=4, base_port=31000)
    args = server_args(cfg, port=31001)
    assert _flag_value(args, "--port") == "31001" and _flag_value(args, "--tp-size") == "4"
    assert "--enable-return-routed-experts" in args and "--enable-memory-saver" in args
    assert _flag_value(args, "--sampling-mask-max-tokens") == str(cfg.sampling_mask_max_tokens)
    assert "--enable-lora" not in args

    with pytest.raises(ValueError, match="target modules"):
        server_args(EnginePoolConfig(model_path="/m", lora_max_rank=16), port=30000)
    lora = server_args(
        EnginePoolConfig(
            model_path="/m", lora_max_rank=16, lora_target_modules=["o_proj", "q_proj"], enable_memory_saver=False
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

    pool = EnginePool(cfg)
    assert pool.replica_urls == ["http://127.0.0.1:31000", "http://127.0.0.1:31001"]
    router = router_args(cfg, pool.replica_urls)
    assert router[router.index("--worker-urls") + 1 : router.index("--host")] == pool.replica_urls


@pytest.mark.e2e
def test_replicas_get_disjoint_visible_gpus(monkeypatch):
    pool = EnginePool(EnginePoolConfig(model_path="/m", replicas=2, gpus_per_replica=2))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert [pool._gpus(i) for i in range(2)] == ["4,5", "6,7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(RuntimeError, match="need 4 GPUs; 3 visible"):
        pool._gpus(0)
    # Without CUDA_VISIBLE_DEVICES, the node's GPUs: 8 trainer ranks leave no room for an engine on an 8-GPU node.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr("moerl.engines.pool._gpu_count", lambda: 8)
    after_trainer = EnginePool(EnginePoolConfig(model_path="/m", replicas=1, gpus_per_replica=2, gpu_offset=8))
    with pytest.raises(RuntimeError, match="need 10 GPUs; 8 visible"):
        after_trainer._gpus(0)
    assert EnginePool(EnginePoolConfig(model_path="/m", replicas=2, gpus_per_replica=2, gpu_offset=4))._gpus(1) == "6,7"


def _stand_in_python(tmp_path):
    """An interpreter path for EnginePool that starts ``moerl serve`` where it is asked for
    ``-m sglang.launch_server``, so the pool's real start/health/stop path runs on CPU."""
    script = tmp_path / "python-standin"
    script.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "args = sys.argv[1:]\n"
        "assert args[:2] == ['-m', 'sglang.launch_server'], args\n"
        "model, port = args[args.index('--model-path') + 1], args[args.index('--port') + 1]\n"
        "os.execv(sys.executable, [sys.executable, '-m', 'moerl.cli', 'serve', '--model', model, '--port', port])\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


@pytest.mark.e2e
def test_pool_starts_replicas_serves_and_stops(tmp_path, monkeypatch):
    """Replica 0 is first given a port another process holds: it fails to bind and starts again elsewhere."""
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
    monkeypatch.setattr(pool_module, "_gpu_count", lambda: 2)  # the stand-in servers' GPUs
    cfg = EnginePoolConfig(model_path=str(model), replicas=2, base_port=0, log_dir=str(tmp_path / "logs"))
    pool = EnginePool(cfg, python=_stand_in_python(tmp_path))

    async def generate_on_both(urls):
        async with EngineClient(urls) as client:
            params = {"max_new_tokens": 3, "temperature": 0.0}
            outs = await asyncio.gather(*(client.generate([5, 6, 7], params) for _ in range(4)))
            return [o[0].output_ids for o in outs], await client.weight_versions()

    with squatter, pool:
        procs = list(pool.procs)
        outputs, versions = asyncio.run(generate_on_both(pool.urls))
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
def test_pool_reports_a_server_that_dies_during_startup(tmp_path, monkeypatch):
    monkeypatch.setattr("moerl.engines.pool._gpu_count", lambda: 1)  # the stand-in server's GPU
    cfg = EnginePoolConfig(model_path=str(tmp_path / "no-such-model"), log_dir=str(tmp_path / "logs"))
    pool = EnginePool(cfg, python=_stand_in_python(tmp_path))
    with pytest.raises(RuntimeError, match="exited during start-up"):
        pool.start(timeout_s=60)
    assert pool.procs == []


# ---- against SGLang's own code, where it imports --------------------------------------------------


@pytest.fixture(scope="module")
def sglang_io():
    pytest.importorskip("sglang.srt.entrypoints.api_contract", reason="sglang is not importable here")
    import sglang.srt.managers.io_struct as io

    return io


def test_server_args_parse_with_sglangs_parser(sglang_io):
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        server_args(
            EnginePoolConfig(
                model_path="/m",
                gpus_per_replica=2,
                lora_max_rank=8,
                lora_target_modules=["down_proj", "gate_proj", "q_proj"],
            ),
            port=30000,
        )
    )
    assert ns.lora_target_modules == ["down_proj", "gate_proj", "q_proj"]
    assert ns.enable_return_routed_experts and ns.enable_memory_saver and ns.enable_lora
    assert (ns.tp_size, ns.max_lora_rank, ns.lora_backend, ns.moe_a2a_backend, ns.moe_runner_backend) == (
        2,
        8,
        "triton_v2",
        "none",
        "lora_triton",
    )
    assert ns.sampling_mask_max_tokens == EnginePoolConfig.sampling_mask_max_tokens


def _captured_bodies() -> list[tuple[str, dict]]:
    """Every route and body moerl's client sends, captured at the transport."""
    sent: list[tuple[str, dict]] = []

    class Capturing(EngineClient):
        async def _call(self, url, route, request=None):
            sent.append((route.path, request.body() if request is not None else None))
            if route.path == "/generate":
                return {
                    "output_ids": [1],
                    "meta_info": {
                        "id": "r",
                        "prompt_tokens": 2,
                        "finish_reason": {"type": "length"},
                        "routed_experts": encode_routed_experts(np.zeros((2, 2, 2), np.int32)),
                        "output_token_sampling_mask": [[1]],
                    },
                }
            if route.path == "/classify":
                return [{"embedding": [0.5], "meta_info": {"id": None, "prompt_tokens": 2}}]
            return {"weight_version": "0"}

    async def run():
        client = Capturing(["http://x"], shape=ModelShape(2, 2, [0, 1], 4))
        await client.generate(
            [1, 2],
            {"max_new_tokens": 1, "top_k": 5, "n": 1},
            return_routed_experts=True,
            routed_experts_start_len=1,
            return_sampling_mask=True,
            rid="r",
            lora_path="a",
        )
        await client.generate(
            [1, 2], {"temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "stop_token_ids": [3], "ignore_eos": False}
        )
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
            lambda url: ["payload"] * 2, "flattened_bucket", weight_version="5", flush_cache=False
        )

    asyncio.run(run())
    return sent


def test_client_bodies_validate_against_sglangs_request_types(sglang_io):
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    io = sglang_io
    types = {
        "/generate": io.GenerateReqInput,
        "/pause_generation": io.PauseGenerationReqInput,
        "/continue_generation": io.ContinueGenerationReqInput,
        "/abort_request": io.AbortReq,
        "/update_weight_version": io.UpdateWeightVersionReqInput,
        "/update_weights_from_disk": io.UpdateWeightFromDiskReqInput,
        "/init_weights_update_group": io.InitWeightsUpdateGroupReqInput,
        "/begin_weight_update": io.BeginWeightUpdateReqInput,
        "/end_weight_update": io.EndWeightUpdateReqInput,
        "/update_weights_from_distributed": io.UpdateWeightsFromDistributedReqInput,
        "/load_lora_adapter": io.LoadLoRAAdapterReqInput,
        "/load_lora_adapter_from_tensors": io.LoadLoRAAdapterFromTensorsReqInput,
        "/unload_lora_adapter": io.UnloadLoRAAdapterReqInput,
        "/release_memory_occupation": io.ReleaseMemoryOccupationReqInput,
        "/resume_memory_occupation": io.ResumeMemoryOccupationReqInput,
        "/update_weights_from_tensor": io.UpdateWeightsFromTensorReqInput,
        "/classify": io.EmbeddingReqInput,
    }
    sent = _captured_bodies()
    assert {route for route, _ in sent} == set(types) | {"/model_info"}
    for route, body in sent:
        if route == "/model_info":
            continue
        kind = types[route]
        # SGLang ignores unknown fields silently, so a misspelled one would be lost: check names too.
        assert set(body) <= set(
            kind.__struct_fields__ if hasattr(kind, "__struct_fields__") else kind.__dataclass_fields__
        ), (route, body)
        parsed = TypeAdapter(kind).validate_python(body)
        if route == "/generate":
            assert generate_contract_error(body) is None, body
            parsed.normalize_batch_and_arguments()
            assert parsed.input_ids == body["input_ids"]


def test_a_tensor_payload_is_read_by_sglangs_unpickler_and_bucket():
    """What moerl hands SGLang's /update_weights_from_tensor passes its restricted unpickler, and its weight updater's
    reading of the metadata rebuilds every tensor; a bucket SGLang's own classes make is read by the embedded engine."""
    pytest.importorskip("sglang.srt.utils.common", reason="sglang is not importable here")
    import torch.multiprocessing
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    from moerl.engines import tensor_ipc

    named = [("a", torch.randn(3, 4)), ("b", torch.arange(5)), ("c", torch.randn(2, 2).bfloat16())]
    data = MultiprocessingSerializer.deserialize(tensor_ipc.serialize(tensor_ipc.flattened_bucket(named)))
    metadata = [  # as weight_updater._update_weights_from_flattened_bucket converts them
        FlattenedTensorMetadata(
            name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
        )
        for m in data["metadata"]
    ]
    rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()
    assert [n for n, _ in rebuilt] == [n for n, _ in named]
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(named, rebuilt, strict=True))
    pairs = MultiprocessingSerializer.deserialize(tensor_ipc.serialize(named))
    assert all(n == m and torch.equal(t, u) for (n, t), (m, u) in zip(named, pairs, strict=True))
    theirs = FlattenedTensorBucket(named_tensors=named)
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        payload = MultiprocessingSerializer.serialize(
            {"flattened_tensor": theirs.get_flattened_tensor(), "metadata": theirs.get_metadata()}, output_str=True
        )
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    ours = tensor_ipc.load_payload(payload, "flattened_bucket")
    assert all(torch.equal(t, u) for (_, t), (_, u) in zip(named, ours, strict=True))


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "top_k": 5}, "return_sampling_mask": True},
        {"input_ids": [1, 2], "sampling_params": {"top_kk": 5}},
        {"input_ids": "12"},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "4"}},
        {"input_ids": [1], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [1], "return_logprob": "yes"},
        {"input_ids": [1], "sampling_params": {"stop_token_ids": "3"}},
    ],
)
def test_generate_bodies_sglangs_contract_refuses_are_refused_here(sglang_io, body):
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    theirs = generate_contract_error(body)
    if theirs is None:
        GenerateReqInput.parse(body)
    else:
        with pytest.raises(ProtocolError):
            GenerateReqInput.parse(body)


def test_routing_and_mask_codecs_match_sglangs(sglang_io):
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.sampling.sampling_mask import SamplingMaskRows
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    rng = np.random.default_rng(0)
    routing = rng.integers(0, 60, size=(7, 3, 4), dtype=np.int32)
    (theirs,) = DetokenizerManager._b64_encode_per_request([torch.from_numpy(routing)])
    assert np.array_equal(decode_routed_experts(theirs, 3, 4, [0, 2], 60), routing[:, [0, 2]])
    ours = encode_routed_experts(routing)
    assert np.array_equal(
        extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": ours}}), routing.ravel()
    )

    rows = SamplingMaskRows()
    kept = [rng.choice(1000, size=k, replace=False).astype(np.int32) for k in (1, 5, 3, 8)]
    for ids in kept:
        rows.append(ids, np.zeros(len(ids), np.float32))
    masks, _ = rows.view().to_lists(support_logprobs=True)
    offsets, ids = decode_sampling_masks(masks)
    assert offsets.tolist() == [0, 1, 6, 9, 17]
    assert all(np.array_equal(ids[offsets[t] : offsets[t + 1]], kept[t]) for t in range(len(kept)))
