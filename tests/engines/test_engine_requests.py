"""The embedded engine under bad and hostile requests: every one answered with a JSON 4xx naming the
problem, quickly, and the server still serving the same weights afterwards."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import socket
import threading
import time

import aiohttp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from moerl.engines import protocol as P
from moerl.engines.client import ByteBudget, EngineClient
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_server

ARCH = "Qwen3MoeForCausalLM"
PROMPT = [3, 17, 42, 99, 7]
GREEDY = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
QUICK_S = 10.0  # every refusal comes back within this


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return hostile_models(tmp_path_factory.mktemp("hostile"))


def hostile_models(root):
    base = save_tiny_hf(ARCH, root / "base")
    other = save_tiny_hf(ARCH, root / "other", seed=1)
    bigger_vocab = save_tiny_hf(ARCH, root / "bigger-vocab", seed=1, vocab_size=300)  # same architecture, other shapes
    (root / "empty").mkdir()
    (root / "config-only").mkdir()
    shutil.copy(base / "config.json", root / "config-only" / "config.json")
    corrupt = root / "corrupt"
    shutil.copytree(base, corrupt)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return {
        "base": base,
        "other": other,
        "bigger-vocab": bigger_vocab,
        "empty": root / "empty",
        "config-only": root / "config-only",
        "corrupt": corrupt,
    }


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with running_server(models["base"], tmp_path_factory.mktemp("log")) as url:
        yield url


def run(coro):
    return asyncio.run(coro)


async def _request(url: str, path: str, body=None, *, raw: bytes | None = None, headers=None, method: str = "POST"):
    """(status, decoded JSON answer or text, seconds)."""
    start = time.monotonic()
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3 * QUICK_S)) as session:
        async with session.request(
            method, url + path, data=data, headers=headers or {"Content-Type": "application/json"}
        ) as resp:
            text = await resp.text()
            try:
                answer = json.loads(text)
            except json.JSONDecodeError:
                answer = text
            return resp.status, answer, time.monotonic() - start


def request(url, path, body=None, **kwargs):
    return run(_request(url, path, body, **kwargs))


def greedy(url) -> list[int]:
    status, answer, _ = request(url, "/generate", GREEDY)
    assert status == 200, answer
    return answer["output_ids"]


@pytest.fixture(scope="module")
def reference(server) -> list[int]:
    return greedy(server)


def assert_refused(status, answer, seconds, *names):
    assert 400 <= status < 500, (status, answer)
    message = answer["error"]["message"]
    assert all(name in message for name in names), message
    assert seconds < QUICK_S


def assert_unchanged(url, reference):
    status, info, _ = request(url, "/model_info", method="GET")
    assert status == 200 and info["weight_version"] == "default"
    assert greedy(url) == reference


DEEP = b"[" * 10_000 + b"]" * 10_000


@pytest.mark.e2e
@pytest.mark.parametrize(
    "path, raw, headers, names",
    [
        ("/generate", b'{"input_ids": [1, 2], "text": "\xff\xfe"}', None, ["text", "not valid Unicode"]),
        ("/generate", DEEP, None, ["Invalid JSON"]),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"n": 1' + b"0" * 5000 + b"}}", None, ["Invalid JSON"]),
        ("/generate", b'{"text": "\\ud800 lonely"}', None, ["text", "not valid Unicode"]),
        ("/generate", b'{"input_ids": [1], "rid": "\\udc00"}', None, ["rid", "not valid Unicode"]),
        (
            "/load_lora_adapter",
            b'{"lora_name": "a", "lora_path": "/x\\ud83d"}',
            None,
            ["lora_path", "not valid Unicode"],
        ),
        ("/generate", b'{"input_ids": [1]}', {"Content-Type": "application/json; charset=bogus"}, ["charset 'bogus'"]),
        (
            "/generate",
            b'{"input_ids": [1], "sampling_params": {"temperature": NaN}}',
            None,
            ["sampling_params.temperature"],
        ),
        (
            "/generate",
            b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}',
            None,
            ["sampling_params.temperature"],
        ),
        ("/pause_generation", b'{"mode": 3}', None, ["mode"]),
        ("/abort_request", b"[1, 2]", None, ["Input should be an object"]),
    ],
    ids=[
        "non-utf8",
        "deep-nesting",
        "huge-integer",
        "lone-surrogate",
        "lone-trailing-surrogate",
        "lone-surrogate-path",
        "bogus-charset",
        "nan",
        "infinity",
        "wrong-type",
        "not-an-object",
    ],
)
def test_malformed_bodies_get_a_json_400(server, reference, path, raw, headers, names):
    assert_refused(*request(server, path, raw=raw, headers=headers), *names)
    assert_unchanged(server, reference)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "path, body, names",
    [
        ("/generate", {"input_ids": PROMPT, "sampling_params": {"n": 10**12}}, ["sampling_params.n"]),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"sampling_seed": 2**70}},
            ["sampling_params.sampling_seed"],
        ),
        ("/generate", {"input_ids": PROMPT, "sampling_params": 0}, ["sampling_params"]),
        ("/generate", {"input_ids": PROMPT, "sampling_params": []}, ["sampling_params"]),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": 0}},
            ["sampling_params.stop_token_ids"],
        ),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"stop_token_ids": [10**6]}},
            ["stop_token_ids", "outside the vocabulary"],
        ),
        ("/generate", {"input_ids": [5] * 600}, ["longer than the model's context length (512 tokens)"]),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 510}},
            ["maximum context length of 512"],
        ),
        ("/abort_request", {"abort_all": "false"}, ["abort_all"]),
        ("/update_weight_version", {"new_version": "v", "abort_all_requests": 1}, ["abort_all_requests"]),
        ("/update_weight_version", {"new_version": 7}, ["new_version"]),
        ("/update_weights_from_disk", {"model_path": "/tmp", "weight_version": 3}, ["weight_version"]),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": "29500", "rank_offset": 1, "world_size": 2},
            ["master_port"],
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 70000, "rank_offset": 1, "world_size": 2},
            ["master_port"],
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 2, "world_size": 2},
            ["rank_offset=2"],
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["model.layers.0.mlp.experts.999.gate_proj.weight"], "dtypes": ["float32"], "shapes": [[32, 64]]},
            ["experts.999.gate_proj.weight: not a weight of the served model"],
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[10**9, 10**9]]},
            ["model.norm.weight: shape"],
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["model.norm.weight"], "dtypes": ["float33"], "shapes": [[64]]},
            ["dtypes.0"],
        ),
        (
            "/get_weights_by_name",
            {"name": "model.layers.0.mlp.experts.999.down_proj.weight"},
            ["not a weight of the served model"],
        ),
        ("/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": "all"}, ["truncate_size"]),
        ("/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, ["lora_name"]),
        ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/x\u0000y"}, ["lora_path", "NUL"]),
        ("/unload_lora_adapter", {"lora_name": ["a"]}, ["lora_name"]),
    ],
)
def test_wrong_types_and_ranges_get_a_400_naming_the_field(server, reference, path, body, names):
    assert_refused(*request(server, path, body), *names)
    assert_unchanged(server, reference)


@pytest.mark.e2e
def test_wrong_methods_and_routes_answer_json(server):
    status, answer, _ = request(server, "/generate", method="GET")
    assert status == 405 and "GET /generate" in answer["error"]["message"]
    status, answer, _ = request(server, "/no_such_route", {})
    assert status == 404 and answer["error"]["code"] == 404


@pytest.mark.e2e
def test_a_tiny_temperature_is_greedy_and_the_answer_is_valid_json(server, reference):
    body = {**GREEDY, "sampling_params": {**GREEDY["sampling_params"], "temperature": 1e-9}, "return_logprob": True}
    status, answer, _ = request(server, "/generate", body)  # a NaN would come back as null, as from SGLang
    assert status == 200 and answer["output_ids"] == reference
    assert all(np.isfinite(lp) for lp, _, _ in answer["meta_info"]["output_token_logprobs"])


@pytest.mark.e2e
@pytest.mark.parametrize(
    "which, names",
    [
        ("/", ["neither model.safetensors nor model.safetensors.index.json"]),
        ("/etc", ["neither model.safetensors"]),
        ("empty", ["neither model.safetensors"]),
        ("config-only", ["neither model.safetensors"]),
        ("corrupt", ["model.safetensors"]),
        ("bigger-vocab", ["wrong shapes", "model.embed_tokens.weight"]),
        ("missing", ["is not a directory"]),
    ],
)
def test_a_disk_update_from_anything_but_this_model_changes_nothing(server, reference, models, which, names):
    path = which if which.startswith("/") else str(models.get(which, models["empty"] / "no-such-dir"))
    assert_refused(*request(server, "/update_weights_from_disk", {"model_path": path, "weight_version": "v9"}), *names)
    assert_unchanged(server, reference)  # the version too: nothing of a refused update lands


@pytest.mark.e2e
def test_a_flushing_update_during_an_in_place_pause_is_refused_untouched(server, reference, models):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}, "stream": True}
            resp = await session.post(server + "/generate", json=body)
            await resp.content.readline()  # generation is under way
            await client.pause("in_place")
            refused = await _request(
                server, "/update_weights_from_disk", {"model_path": str(models["other"]), "weight_version": "v2"}
            )
            version = (await client.weight_versions())[0]
            await client.abort()
            await client.resume()
            resp.close()
            return refused, version

    refused, version = run(go())
    assert_refused(*refused, "cache cannot be flushed while requests are running", "flush_cache=false")
    assert version == "default"
    assert_unchanged(server, reference)


@pytest.mark.e2e
def test_abort_by_rid_aborts_all_n_completions(server):
    """Those running end with their tokens; those still waiting for a place in the batch (64 run at once) are answered
    as SGLang answers them, without prompt_tokens, and the client takes the prompt's length from its request."""
    n = 70  # x 500 tokens takes ~9 s here: still running at the abort (n=4 could finish first on a warm, idle machine)

    async def go():
        async with aiohttp.ClientSession() as session:
            body = {
                "input_ids": PROMPT,
                "rid": "many",
                "sampling_params": {"n": n, "max_new_tokens": 500, "ignore_eos": True},
            }
            pending = asyncio.ensure_future(session.post(server + "/generate", json=body))
            await asyncio.sleep(1.0)
            aborted = await _request(server, "/abort_request", {"rid": "many"})
            resp = await pending
            return aborted, await resp.json()

    (status, answer, _), completions = run(go())
    assert status == 200 and answer["aborted"] == n
    assert [c["meta_info"]["id"] for c in completions] == [f"many-{i}" for i in range(n)]
    assert all(c["meta_info"]["finish_reason"]["type"] == "abort" and len(c["output_ids"]) < 500 for c in completions)
    waiting = [c for c in completions if "prompt_tokens" not in c["meta_info"]]
    assert len(waiting) == n - 64
    assert all(c["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue" for c in waiting)
    assert all(P.decode_generate(c, None, prompt_len=len(PROMPT)).prompt_len == len(PROMPT) for c in waiting)


@pytest.mark.e2e
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_has_its_requests_aborted(server, stream):
    async def go():
        # n=64 x 500 tokens takes ~9 s here: still running 4 s after the client left, unless aborted.
        body = {
            "input_ids": PROMPT,
            "stream": stream,
            "sampling_params": {"n": 64, "max_new_tokens": 500, "ignore_eos": True},
        }
        async with aiohttp.ClientSession() as session:
            with pytest.raises(asyncio.TimeoutError):
                async with session.post(
                    server + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=1.0)
                ) as resp:
                    await resp.read()
        await asyncio.sleep(3 * 1.0)  # the server notices within its poll interval
        return await _request(server, "/abort_request", {"abort_all": True})

    status, answer, _ = run(go())
    assert status == 200 and answer["aborted"] == 0  # nothing left running for nobody


@pytest.mark.e2e
def test_a_join_to_a_refused_port_fails_fast_and_slow_joins_starve_nothing(server, models):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        status, answer, seconds = request(
            server,
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": port,
                "rank_offset": 1,
                "world_size": 2,
                "group_name": "g0",
                "backend": "gloo",
            },
        )
    assert_refused(status, answer, seconds, "cannot reach the trainer's store")

    # Stores that accept a connection and never answer: the joins wait for their peers, and the disk
    # and adapter routes still answer at once.
    silent = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: [accepted.append(silent.accept()) for _ in range(4)], daemon=True).start()

    async def go():
        joins = [
            asyncio.ensure_future(
                _request(
                    server,
                    "/init_weights_update_group",
                    {
                        "master_address": "127.0.0.1",
                        "master_port": silent.getsockname()[1],
                        "rank_offset": 1,
                        "world_size": 2,
                        "group_name": f"slow{i}",
                        "backend": "gloo",
                    },
                )
            )
            for i in range(3)
        ]
        await asyncio.sleep(1.0)
        results = [
            await _request(server, "/update_weights_from_disk", {"model_path": str(models["empty"])}),
            await _request(server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(models["empty"])}),
            await _request(server, "/model_info", method="GET"),
        ]
        for j in joins:
            j.cancel()
        return results

    disk, lora, info = run(go())
    assert disk[0] == 400 and lora[0] == 400 and info[0] == 200
    assert max(r[2] for r in (disk, lora, info)) < 2.0
    silent.close()


def _adapter(
    tmp_path,
    model_dir,
    rank=4,
    config_rank=None,
    module="model.layers.0.self_attn.q_proj",
    dtype=torch.float32,
    value=0.5,
    name="adapter",
):
    cfg = json.loads((model_dir / "config.json").read_text())
    h = cfg["hidden_size"]
    out_dim = (
        cfg["num_attention_heads"] * cfg["head_dim"] if module.endswith("q_proj") else cfg["moe_intermediate_size"]
    )
    path = tmp_path / name
    path.mkdir()
    g = torch.Generator().manual_seed(0)
    save_file(
        {
            f"base_model.model.{module}.lora_A.weight": (torch.randn(rank, h, generator=g) * value).to(dtype),
            f"base_model.model.{module}.lora_B.weight": (torch.randn(out_dim, rank, generator=g) * value).to(dtype),
        },
        str(path / "adapter_model.safetensors"),
    )
    (path / "adapter_config.json").write_text(
        json.dumps({"r": config_rank or rank, "lora_alpha": 8, "peft_type": "LORA"})
    )
    return path


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kind, names",
    [
        ("rank", ["should be (8,", "r=8"]),
        ("expert", ["experts.99.gate_proj: not a linear layer of the served model"]),
        ("dtype", ["must be floating point"]),
        ("nan", ["NaN or infinite"]),
        ("corrupt", ["not a readable safetensors file"]),
        ("config", ["adapter_config.json", "not valid JSON"]),
        ("config-list", ["adapter_config.json", "must be a JSON object, got list"]),
        ("config-rank-text", ["adapter_config.json", "r:"]),
        ("config-alpha-bool", ["adapter_config.json", "lora_alpha"]),
        ("config-targets-number", ["adapter_config.json", "target_modules"]),
        ("config-rslora-text", ["adapter_config.json", "use_rslora"]),
    ],
)
def test_adapters_that_are_not_what_they_claim_are_refused(server, reference, models, tmp_path, kind, names):
    base = models["base"]
    path = {
        "rank": lambda: _adapter(tmp_path, base, rank=4, config_rank=8),
        "expert": lambda: _adapter(tmp_path, base, module="model.layers.0.mlp.experts.99.gate_proj"),
        "dtype": lambda: _adapter(tmp_path, base, dtype=torch.int32, value=10),
        "nan": lambda: _adapter(tmp_path, base, value=float("nan")),
        "corrupt": lambda: _adapter(tmp_path, base),
    }.get(kind, lambda: _adapter(tmp_path, base))()
    if kind == "corrupt":
        (path / "adapter_model.safetensors").write_bytes(b"\x00" * 40)
    config = {
        "config": "{r: 4",
        "config-list": "[4, 8]",
        "config-rank-text": '{"r": "4", "lora_alpha": 8}',
        "config-alpha-bool": '{"r": 4, "lora_alpha": true}',
        "config-targets-number": '{"r": 4, "lora_alpha": 8, "target_modules": 3}',
        "config-rslora-text": '{"r": 4, "lora_alpha": 8, "use_rslora": "yes"}',
    }.get(kind)
    if config is not None:
        (path / "adapter_config.json").write_text(config)
    assert_refused(*request(server, "/load_lora_adapter", {"lora_name": f"bad-{kind}", "lora_path": str(path)}), *names)
    status, answer, _ = request(
        server,
        "/load_lora_adapter_from_tensors",
        {
            "lora_name": "garbage",
            "config_dict": {"r": 4, "lora_alpha": 8},
            "serialized_named_tensors": ["%%%"],
            "load_format": "safetensors",
        },
    )
    assert_refused(status, answer, 0.0, "not base64")
    assert_unchanged(server, reference)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "config, names",
    [
        ({"r": [4], "lora_alpha": 8}, ["config_dict", "r:"]),
        ({"r": 4, "lora_alpha": "8"}, ["config_dict", "lora_alpha"]),
        ({"r": 4, "lora_alpha": 8, "bias": "all"}, ["config_dict", "unsupported settings"]),
    ],
)
def test_a_malformed_tensor_adapters_config_is_refused_naming_config_dict(
    server, reference, models, tmp_path, config, names
):
    payload = base64.b64encode((_adapter(tmp_path, models["base"]) / "adapter_model.safetensors").read_bytes()).decode()
    assert_refused(
        *request(
            server,
            "/load_lora_adapter_from_tensors",
            {
                "lora_name": "bad-config",
                "config_dict": config,
                "serialized_named_tensors": [payload],
                "load_format": "safetensors",
            },
        ),
        *names,
    )
    assert_unchanged(server, reference)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/update_weights_from_disk", {"model_path": "/tmp/" + "x" * 5000}, "model_path"),
        ("/update_weights_from_disk", {"model_path": "/" + "d/" * 3000}, "model_path"),
        ("/load_lora_adapter", {"lora_name": "long", "lora_path": "/tmp/" + "x" * 5000}, "lora_path"),
    ],
)
def test_a_path_the_os_refuses_gets_a_400_naming_the_field(server, reference, path, body, field):
    status, answer, seconds = request(server, path, body)
    assert_refused(status, answer, seconds, field)
    assert len(answer["error"]["message"]) < 500  # the path is not echoed whole
    assert_unchanged(server, reference)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "body, names",
    [
        ({**GREEDY, "bogus": None}, ["unknown", "bogus"]),
        (
            {**GREEDY, "sampling_params": {**GREEDY["sampling_params"], "bogus": None}},
            ["unknown", "sampling_params.bogus"],
        ),
    ],
)
def test_an_unknown_field_is_refused_whatever_its_value(server, reference, body, names):
    assert_refused(*request(server, "/generate", body), *names)
    assert_unchanged(server, reference)


@pytest.mark.e2e
def test_weights_read_back_are_the_base_weights_after_an_adapter_was_used(server, reference, models, tmp_path):
    from safetensors.torch import load_file

    adapter = _adapter(tmp_path, models["base"])
    name = "model.layers.0.self_attn.q_proj.weight"
    base = load_file(str(models["base"] / "model.safetensors"))[name]
    status, _, _ = request(server, "/load_lora_adapter", {"lora_name": "used", "lora_path": str(adapter)})
    assert status == 200
    status, adapted, _ = request(server, "/generate", {**GREEDY, "lora_path": "used"})
    assert status == 200 and adapted["output_ids"] != reference  # the adapter changes what is sampled
    status, served, _ = request(server, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
    assert status == 200 and torch.equal(torch.tensor(served), base)
    assert request(server, "/unload_lora_adapter", {"lora_name": "used"})[0] == 200
    assert_unchanged(server, reference)


# ---- property: any corrupted body on any route is a 4xx naming what is wrong ---------------------
BODIES = {  # a valid body per route, each corrupted before it is sent
    "/generate": GREEDY,
    "/pause_generation": {"mode": "in_place"},
    "/continue_generation": {},
    "/abort_request": {"rid": "nobody"},
    "/update_weight_version": {"new_version": "v1", "abort_all_requests": False},
    "/update_weights_from_disk": {"model_path": "/nonexistent", "weight_version": "v1", "flush_cache": False},
    "/init_weights_update_group": {
        "master_address": "127.0.0.1",
        "master_port": 9,
        "rank_offset": 1,
        "world_size": 2,
        "group_name": "fuzz",
        "backend": "gloo",
    },
    "/begin_weight_update": {"selector": "all"},
    "/end_weight_update": {},
    "/update_weights_from_distributed": {
        "names": ["model.norm.weight"],
        "dtypes": ["float32"],
        "shapes": [[64]],
        "group_name": "fuzz",
    },
    "/get_weights_by_name": {"name": "model.norm.weight", "truncate_size": 3},
    "/load_lora_adapter": {"lora_name": "fuzz", "lora_path": "/nonexistent"},
    "/load_lora_adapter_from_tensors": {
        "lora_name": "fuzz",
        "config_dict": {"r": 2},
        "serialized_named_tensors": ["AA=="],
        "load_format": "safetensors",
    },
    "/unload_lora_adapter": {"lora_name": "fuzz"},
    "/release_memory_occupation": {"tags": ["kv_cache"]},
    "/resume_memory_occupation": {"tags": ["weights"]},
    "/update_weights_from_tensor": {"serialized_named_tensors": ["AA=="], "load_format": "flattened_bucket"},
}
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def corrupted(draw):
    path = draw(st.sampled_from(sorted(BODIES)))
    body = json.loads(json.dumps(BODIES[path]))
    how = draw(
        st.sampled_from(["value", "nested", "unknown", "not-an-object"] if body else ["unknown", "not-an-object"])
    )
    if how == "value":
        key = draw(st.sampled_from(sorted(body)))
        body[key] = draw(JSON_VALUES)
        return path, body, key
    if how == "nested" and isinstance(body.get("sampling_params"), dict):
        key = draw(
            st.sampled_from(
                [
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "max_new_tokens",
                    "n",
                    "sampling_seed",
                    "stop_token_ids",
                    "ignore_eos",
                ]
            )
        )
        body["sampling_params"][key] = draw(JSON_VALUES)
        return path, body, key
    if how in ("unknown", "nested"):
        key = draw(
            st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12).filter(lambda k: k not in body)
        )
        body[key] = draw(JSON_VALUES)
        return path, body, key
    return path, draw(JSON_VALUES.filter(lambda v: not isinstance(v, dict))), ""


KINDS = {  # route -> its request type, to know which corrupted bodies are still well-formed
    "/generate": P.GenerateReqInput,
    "/pause_generation": P.PauseGenerationReqInput,
    "/continue_generation": P.ContinueGenerationReqInput,
    "/abort_request": P.AbortReq,
    "/update_weight_version": P.UpdateWeightVersionReqInput,
    "/update_weights_from_disk": P.UpdateWeightFromDiskReqInput,
    "/init_weights_update_group": P.InitWeightsUpdateGroupReqInput,
    "/begin_weight_update": P.BeginWeightUpdateReqInput,
    "/end_weight_update": P.EndWeightUpdateReqInput,
    "/update_weights_from_distributed": P.UpdateWeightsFromDistributedReqInput,
    "/get_weights_by_name": P.GetWeightsByNameReqInput,
    "/load_lora_adapter": P.LoadLoRAAdapterReqInput,
    "/load_lora_adapter_from_tensors": P.LoadLoRAAdapterFromTensorsReqInput,
    "/unload_lora_adapter": P.UnloadLoRAAdapterReqInput,
    "/release_memory_occupation": P.ReleaseMemoryOccupationReqInput,
    "/resume_memory_occupation": P.ResumeMemoryOccupationReqInput,
    "/update_weights_from_tensor": P.UpdateWeightsFromTensorReqInput,
}
HARMLESS_WHEN_VALID = {"/generate", "/get_weights_by_name", "/abort_request"}


@pytest.mark.e2e
@settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=corrupted())
def test_any_corrupted_body_on_any_route_is_refused_and_changes_nothing(server, reference, case):
    from hypothesis import assume

    path, body, key = case
    try:
        KINDS[path].parse(body)
        well_formed = True
    except P.ProtocolError:
        well_formed = False
    # A corruption that happens to be a valid order (say, a pause) would change the engine on purpose.
    assume(not well_formed or path in HARMLESS_WHEN_VALID)
    status, answer, seconds = request(server, path, raw=json.dumps(body).encode())  # a JSON null too, not an empty body
    assert status < 500 and seconds < QUICK_S, (path, body, status, answer)
    if not well_formed:
        assert status == 400, (path, body, status, answer)
        assert key in answer["error"]["message"], (path, body, answer)
    assert request(server, "/health", method="GET")[0] == 200
    assert greedy(server) == reference


def test_a_request_that_fails_alone_fails_alone(models):
    """One request breaking inside the engine (here its prefill) ends with an abort naming the error;
    the requests around it finish normally and the engine keeps serving."""
    from moerl.engines.embedded.engine import EmbeddedEngine

    engine = EmbeddedEngine(str(models["base"]), device="cpu")
    prefill = engine.runner.prefill
    poisoned = [9, 9, 9]

    def breaks_on_poison(tokens, *args):
        if list(tokens) == poisoned:
            raise RuntimeError("poisoned prompt")
        return prefill(tokens, *args)

    engine.runner.prefill = breaks_on_poison
    engine.scheduler.start()
    try:
        results: dict[str, list] = {}
        threads = [
            threading.Thread(
                target=lambda key=key, ids=ids: results.update(
                    {
                        key: engine.generate(
                            {
                                "input_ids": ids,
                                "sampling_params": {
                                    "n": 2,
                                    "max_new_tokens": 30,
                                    "ignore_eos": True,
                                    "sampling_seed": 1,
                                },
                            }
                        )
                    }
                )
            )
            for key, ids in (("before", PROMPT), ("poison", poisoned), ("after", PROMPT[::-1]))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [r["meta_info"]["finish_reason"]["type"] for r in results["poison"]] == ["abort", "abort"]
        assert "poisoned prompt" in results["poison"][0]["meta_info"]["finish_reason"]["message"]
        for key in ("before", "after"):
            assert all(
                r["meta_info"]["finish_reason"]["type"] == "length" and len(r["output_ids"]) == 30 for r in results[key]
            )
        assert engine.generate(GREEDY)[0]["output_ids"]
    finally:
        engine.scheduler.stop()


def test_a_byte_budget_lets_bodies_in_while_they_fit_in_turn_and_one_too_large_alone():
    async def scenario() -> list[str]:
        budget, order = ByteBudget(100), []
        released = {name: asyncio.Event() for name in "abcde"}

        async def read(name: str, size: int) -> None:
            async with budget.hold(size):
                order.append(f"{name} in at {budget.held}")
                await released[name].wait()

        tasks = {}
        for name, size in (("a", 60), ("b", 30), ("c", 50), ("d", 5), ("e", 250)):
            tasks[name] = asyncio.create_task(read(name, size))
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        order.append("c waits, and d behind it though it would fit")
        tasks["c"].cancel()  # d and e move up; d fits
        await asyncio.sleep(0)
        for name in "abd":
            released[name].set()
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        released["e"].set()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        order.append(f"held at the end {budget.held}")
        return order

    assert asyncio.run(scenario()) == [
        "a in at 60",
        "b in at 90",
        "c waits, and d behind it though it would fit",
        "d in at 95",
        "e in at 250",  # larger than the whole budget: once nothing else is held
        "held at the end 0",
    ]
