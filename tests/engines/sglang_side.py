"""SGLang's side of tests/engines/test_sglang_protocol.py, run by SGLang's own interpreter (which has no moerl): reads
one JSON object of inputs on stdin, checks them with SGLang's own code, and prints one JSON object of findings."""

from __future__ import annotations

import argparse
import base64
import json
import sys


def server_args(args: list[str]) -> dict:
    """The launch flags moerl gives a server, parsed by SGLang's own parser."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(args)
    keys = (
        "lora_target_modules",
        "enable_return_routed_experts",
        "enable_memory_saver",
        "enable_lora",
        "tp_size",
        "max_lora_rank",
        "lora_backend",
        "moe_a2a_backend",
        "moe_runner_backend",
        "sampling_mask_max_tokens",
        "is_embedding",
        "device",
        "attention_backend",
        "disable_cuda_graph",
        "max_total_tokens",
        "sleep_on_idle",
    )
    return {key: getattr(ns, key) for key in keys}


def bodies(sent: list[list]) -> list[str]:
    """Each (route, body) moerl's client sends, against SGLang's request type of that route: unknown field names (SGLang
    drops them silently), failed validation, and /generate's contract gate. The problems found."""
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers import io_struct as io

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
    problems = []
    for route, body in sent:
        if route not in types:
            problems.append(f"{route}: no SGLang request type")
            continue
        kind = types[route]
        fields = kind.__struct_fields__ if hasattr(kind, "__struct_fields__") else kind.__dataclass_fields__
        if unknown := set(body) - set(fields):
            problems.append(f"{route}: fields SGLang does not have: {sorted(unknown)}")
        try:
            parsed = TypeAdapter(kind).validate_python(body)
        except Exception as e:  # noqa: BLE001 - reported, whatever it is
            problems.append(f"{route}: {type(e).__name__}: {e}")
            continue
        if route == "/generate":
            if (error := generate_contract_error(body)) is not None:
                problems.append(f"/generate: {error}")
            parsed.normalize_batch_and_arguments()
            if parsed.input_ids != body["input_ids"]:
                problems.append("/generate: input_ids read differently")
    return problems


def contract(generate_bodies: list[dict]) -> list[str | None]:
    """SGLang's /generate contract gate on each body: its refusal, or None."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error

    return [generate_contract_error(body) for body in generate_bodies]


def codecs(routing: list, kept: list[list[int]], ours: str) -> dict:
    """SGLang's routing encoding of ``routing``, its decoding of moerl's encoding ``ours``, and its kept-set rows of
    ``kept`` as the server writes them."""
    import numpy as np
    import torch
    from sglang.srt.managers.detokenizer_manager import DetokenizerManager
    from sglang.srt.sampling.sampling_mask import SamplingMaskRows
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    (encoded,) = DetokenizerManager._b64_encode_per_request([torch.tensor(routing, dtype=torch.int32)])
    decoded = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": ours}})
    rows = SamplingMaskRows()
    for ids in kept:
        rows.append(np.array(ids, dtype=np.int32), np.zeros(len(ids), np.float32))
    masks, _ = rows.view().to_lists(support_logprobs=True)
    return {
        "encoded": encoded if isinstance(encoded, str) else base64.b64encode(encoded).decode(),
        "decoded": np.asarray(decoded).tolist(),
        "masks": [list(map(int, m)) for m in masks],
    }


def tensor_payload(payload: str) -> list:
    """moerl's flattened-bucket payload for /update_weights_from_tensor, read as SGLang's weight updater reads it: its
    restricted unpickler, then the bucket rebuilt from its metadata. Each tensor's name, dtype and values."""
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    data = MultiprocessingSerializer.deserialize(payload)
    metadata = [  # as weight_updater._update_weights_from_flattened_bucket converts them
        FlattenedTensorMetadata(
            name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
        )
        for m in data["metadata"]
    ]
    rebuilt = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=metadata).reconstruct_tensors()
    return [[name, str(t.dtype), t.float().flatten().tolist()] for name, t in rebuilt]


def lora_adapters(adapters: dict[str, dict]) -> dict:
    """:func:`lora_adapter` of each named adapter."""
    return {name: lora_adapter(**inputs) for name, inputs in adapters.items()}


def lora_adapter(adapter: str, model: str) -> dict:
    """An adapter directory of the ``sglang`` format, read by SGLang's own adapter parsing (its config, names, q/k/v and
    gate/up stacking, expert ids, the shared-outer detection) for the model at ``model``: its scale, each module's
    factors (A, B) as SGLang holds them with the Hub modules they stack, and the expert modules it read shared-outer."""
    import re

    from safetensors.torch import load_file
    from sglang.srt.lora.lora import LoRAAdapter
    from sglang.srt.lora.lora_config import LoRAConfig
    from sglang.srt.lora.utils import get_normalized_target_modules, get_target_module_name
    from transformers import AutoConfig

    config = LoRAConfig(adapter)
    read = LoRAAdapter("a", config, AutoConfig.from_pretrained(model), load_config=None, lora_backend=None)
    read.initialize_weights_from_tensors(load_file(f"{adapter}/adapter_model.safetensors"))
    stacks = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    targets = get_normalized_target_modules(config.target_modules)
    modules, shared_outer = {}, []
    for layer in read.layers:
        for key, a in layer.weights.items():
            if ".lora_A." not in key:
                continue
            b = layer.weights[key.replace(".lora_A.", ".lora_B.")]
            module = key.removeprefix("base_model.model.").split(".lora_A.")[0]
            target = get_target_module_name(module, targets)
            if re.search(r"experts\.\d+\.", module) and a.dim() != 2:
                shared_outer.append(module)
            parts = [module.replace(target, leaf) for leaf in stacks.get(target, (target,))]
            modules[module] = {"parts": parts, "a": a.float().tolist(), "b": b.float().tolist()}
    return {"scaling": read.scaling, "modules": modules, "shared_outer": shared_outer}


CHECKS = {
    "server_args": server_args,
    "bodies": bodies,
    "contract": contract,
    "codecs": codecs,
    "tensor": tensor_payload,
    "lora": lora_adapters,
}


if __name__ == "__main__":
    asked = json.load(sys.stdin)
    print(json.dumps({name: CHECKS[name](**inputs) for name, inputs in asked.items()}))
