"""Weight updates, versions, pause/continue and abort on a real embedded server (own process, since
these tests change its weights). The module's tests share one: after each it is brought back to how it started, or
started anew where it cannot be."""

from __future__ import annotations

import asyncio
import base64
import json
from contextlib import ExitStack

import aiohttp
import numpy as np
import pytest

from moerl.engines.client import EngineClient, EngineError
from moerl.models.tiny import save_tiny_hf
from tests.engine_server import running_server

pytestmark = pytest.mark.e2e  # each test starts moerl processes (see pytest.ini)

ARCH = "Qwen2MoeForCausalLM"
PROMPT = [5, 80, 33, 140, 2, 19]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ADAPTERS = ("a", "d", "t")  # the names this module's tests load adapters under


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    where = tmp_path_factory.mktemp("models")
    return save_tiny_hf(ARCH, where / "base"), save_tiny_hf(ARCH, where / "other", seed=1)


class SharedServer:
    """One embedded engine serving the base model, and what it answers as started: its weight version and its greedy
    output for :data:`PROMPT`."""

    def __init__(self, model, log_dir):
        self.model, self.log_dir = model, log_dir
        self.stack = ExitStack()
        self.start()

    def start(self) -> None:
        self.url = self.stack.enter_context(running_server(self.model, self.log_dir))
        self.as_started = asyncio.run(self.state())

    async def state(self) -> tuple[list[str], list[int]]:
        async with EngineClient([self.url], timeout_s=60, retries=0) as client:
            (done,) = await client.generate(PROMPT, GREEDY)
            return await client.weight_versions(), done.output_ids.tolist()

    async def restore(self) -> None:
        """Generation resumed, no weight-update session open, no adapter loaded, the base weights under the version it
        started with."""
        async with EngineClient([self.url], timeout_s=60, retries=0) as client:
            await client.resume()
            for undo in (client.end_weight_update, *(lambda name=name: client.unload_lora(name) for name in ADAPTERS)):
                try:
                    await undo()
                except EngineError as e:
                    if e.status != 400:  # 400: none open, not loaded
                        raise
            await client.update_weights_from_disk(str(self.model), weight_version=self.as_started[0][0])

    def after_a_test(self) -> None:
        """Back to how it started; a server that cannot be (killed, wedged, or answering otherwise) is started anew."""
        try:
            asyncio.run(self.restore())
            if asyncio.run(self.state()) == self.as_started:
                return
        except (EngineError, aiohttp.ClientError, TimeoutError):
            pass
        self.stack.close()
        self.start()


@pytest.fixture(scope="module")
def shared_server(models, tmp_path_factory):
    shared = SharedServer(models[0], tmp_path_factory.mktemp("logs"))
    with shared.stack:
        yield shared


@pytest.fixture
def server(shared_server):
    yield shared_server.url
    shared_server.after_a_test()


async def _stream_until_tokens(session, url, body, n):
    """Start a streaming /generate; return (task finishing the stream, last chunk) once n tokens are out."""
    resp = await session.post(url + "/generate", json={**body, "stream": True})
    chunks = []
    async for line in resp.content:
        if line.startswith(b"data: {"):
            chunks.append(json.loads(line[6:]))
            if len(chunks[-1]["output_ids"]) >= n:
                break

    async def rest():
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[6:]))
        resp.release()
        return chunks[-1]

    return asyncio.ensure_future(rest())


def test_weight_update_from_disk_changes_outputs_and_bumps_the_version(server, models):
    async def go():
        async with EngineClient([server]) as client:
            before = (await client.generate(PROMPT, GREEDY))[0]
            assert await client.weight_versions() == ["default"]
            await client.update_weights_from_disk(str(models[1]), weight_version="v2")
            after = (await client.generate(PROMPT, GREEDY))[0]
            assert await client.weight_versions() == ["v2"]
            await client.update_weights_from_disk(str(models[0]), weight_version="v3")
            restored = (await client.generate(PROMPT, GREEDY))[0]
            return before, after, restored

    before, after, restored = asyncio.run(go())
    assert not np.array_equal(before.output_ids, after.output_ids)
    assert np.array_equal(before.output_ids, restored.output_ids)
    assert after.weight_versions == [{"version": "v2", "start": 0, "end": 8}]
    assert restored.weight_versions == [{"version": "v3", "start": 0, "end": 8}]


def test_in_place_update_mid_generation_splits_the_version_spans(server, models):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 0},
            }
            finish = await _stream_until_tokens(session, server, body, 3)
            await client.pause("in_place")
            await client.update_weights_from_disk(str(models[1]), weight_version="v2", flush_cache=False)
            await client.resume()
            return await finish

    final = asyncio.run(go())
    spans = final["meta_info"]["weight_versions"]
    assert len(final["output_ids"]) == 400
    assert [s["version"] for s in spans] == ["default", "v2"]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] and spans[1]["end"] == 400
    assert 3 <= spans[0]["end"] < 400


def test_abort_returns_the_partial_output(server):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {
                "input_ids": PROMPT,
                "rid": "long-one",
                "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
            }
            finish = await _stream_until_tokens(session, server, body, 2)
            await client.abort("long-one")
            return await finish

    final = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(final["output_ids"]) < 500


def test_pause_holds_requests_until_continue(server):
    async def go():
        async with EngineClient([server]) as client:
            await client.pause("in_place")
            task = asyncio.ensure_future(client.generate(PROMPT, GREEDY))
            await asyncio.sleep(1.0)
            held = not task.done()
            await client.resume()
            (c,) = await asyncio.wait_for(task, 60)
            return held, c

    held, c = asyncio.run(go())
    assert held and len(c.output_ids) == 8


def test_pause_with_abort_finishes_running_requests(server):
    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
            finish = await _stream_until_tokens(session, server, body, 2)
            await client.pause("abort")
            final = await finish
            await client.resume()
            (after,) = await client.generate(PROMPT, GREEDY)
            return final, after

    final, after = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(after.output_ids) == 8


def test_retract_then_continue_gives_the_uninterrupted_output(server, models):
    params = {"max_new_tokens": 300, "ignore_eos": True, "temperature": 0.0}

    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            (uninterrupted,) = await client.generate(PROMPT, params)
            finish = await _stream_until_tokens(session, server, {"input_ids": PROMPT, "sampling_params": params}, 3)
            await client.pause("retract")
            await client.resume()
            return uninterrupted, await finish

    uninterrupted, final = asyncio.run(go())
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    # The retracted request is re-prefilled from its prompt and output so far, then decodes on.
    assert final["output_ids"] == uninterrupted.output_ids.tolist()


def test_routing_sampled_before_a_retract_is_kept_when_new_weights_prefill_it_again(server, models):
    """A retract pause, an update, then the request prefilled again under the new weights: the routing returned for the
    positions fed before the retract is what produced those tokens (the old weights'), not the re-prefill's (miles #3277
    pairs old log-probs with re-prefilled routes); positions fed after it carry the new weights' routing."""
    params = {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    body = {"input_ids": PROMPT, "sampling_params": params, "return_routed_experts": True}

    async def routing_of(session, key=None):
        async with session.post(server + "/generate", json={**body, "extra_key": key} if key else body) as resp:
            return _raw_routing(await resp.json())

    async def go():
        async with aiohttp.ClientSession() as session, EngineClient([server]) as client:
            old = await routing_of(session)
            finish = await _stream_until_tokens(session, server, body, 3)
            await client.pause("retract")
            await client.update_weights_from_disk(str(models[1]), weight_version="v2", flush_cache=False)
            await client.resume()
            final = await finish
            # keyed to the new weights: nothing cached before the update is reused
            new = await routing_of(session, key="v2")
            return old, final, new

    old, final, new = asyncio.run(go())
    spans = final["meta_info"]["weight_versions"]
    before = spans[0]["end"]  # tokens sampled under the old weights
    assert spans[0]["version"] != "v2" and spans[-1]["version"] == "v2" and 0 < before < 40
    fed_before = len(PROMPT) + before - 1
    assert not np.array_equal(old[:fed_before], new[:fed_before])  # the two models route differently: the test can tell
    routing = _raw_routing(final)
    assert np.array_equal(routing[:fed_before], old[:fed_before])


def _raw_routing(response: dict) -> np.ndarray:
    """A /generate response's routed experts as SGLang sends them: int32 rows, one per fed position."""
    flat = np.frombuffer(base64.b64decode(response["meta_info"]["routed_experts"]), dtype=np.int32)
    return flat.reshape(len(PROMPT) + len(response["output_ids"]) - 1, -1)


@pytest.mark.parametrize("load_format", [None, "flattened_bucket"])
def test_weight_update_from_distributed_broadcast(server, models, load_format):
    """The test process plays the trainer: rank 0 of a gloo group with the engine at rank 1."""
    import torch.distributed as dist

    from moerl.checkpoint.hf import HFReader
    from moerl.engines.weight_group import flatten_bucket, join_weight_group, weight_store

    reader = HFReader(models[1])
    named = [(n, reader.get(n)) for n in sorted(reader.names())]
    store = weight_store("127.0.0.1", 0, 2, 0)
    group_name = f"wsync-{load_format}"  # group names are process-wide in torch

    async def go():
        async with EngineClient([server]) as client:
            before = (await client.generate(PROMPT, GREEDY))[0]
            joined = asyncio.to_thread(join_weight_group, "gloo", store, 2, 0, group_name)
            group, _ = await asyncio.gather(
                joined, client.init_weights_update_group("127.0.0.1", store.port, 2, group_name, "gloo")
            )
            if load_format == "flattened_bucket":
                flat, names, dtypes, shapes = flatten_bucket(named)
                send = asyncio.to_thread(dist.broadcast, flat, 0, group)
            else:
                names = [n for n, _ in named]
                dtypes = [str(t.dtype).removeprefix("torch.") for _, t in named]
                shapes = [list(t.shape) for _, t in named]
                send = asyncio.to_thread(lambda: [dist.broadcast(t, 0, group) for _, t in named])
            # Outside a weight-update session the engine refuses before receiving anything (SGLang 0.5.23).
            with pytest.raises(EngineError, match="must run between /begin_weight_update and /end_weight_update"):
                await client.update_weights_from_distributed(names, dtypes, shapes, group_name, load_format=load_format)
            await client.begin_weight_update()
            await asyncio.gather(
                send,
                client.update_weights_from_distributed(
                    names, dtypes, shapes, group_name, weight_version="step-1", load_format=load_format
                ),
            )
            await client.end_weight_update()
            pushed = (await client.generate(PROMPT, GREEDY))[0]
            await client.update_weights_from_disk(str(models[1]))
            from_disk = (await client.generate(PROMPT, GREEDY))[0]
            return before, pushed, from_disk

    before, pushed, from_disk = asyncio.run(go())
    assert pushed.weight_versions[0]["version"] == "step-1"
    assert not np.array_equal(before.output_ids, pushed.output_ids)
    assert np.array_equal(pushed.output_ids, from_disk.output_ids)


def test_a_mismatched_weight_update_is_refused_and_changes_nothing(server):
    async def go():
        async with EngineClient([server]) as client:
            before = (await client.generate(PROMPT, GREEDY))[0]
            status, answer = await _post_json(
                server,
                "/update_weights_from_distributed",
                {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3]], "group_name": "nope"},
            )
            after = (await client.generate(PROMPT, GREEDY))[0]
            return before, after, status, answer

    before, after, status, answer = asyncio.run(go())
    assert status == 400 and "model.norm.weight: shape (3,) != served (64,)" in answer["error"]["message"]
    assert np.array_equal(before.output_ids, after.output_ids)


async def _post_json(url, route, body):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + route, json=body) as r:
            return r.status, await r.json(content_type=None)


def _write_adapter(path, model_dir, seed=0):
    """A PEFT-format adapter on attention and on single experts (SGLang's per-expert keys)."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    h, f = cfg["hidden_size"], cfg["moe_intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_dim, in_dim) in {
        "model.layers.0.self_attn.q_proj": (cfg["num_attention_heads"] * (h // cfg["num_attention_heads"]), h),
        "model.layers.1.mlp.experts.2.gate_proj": (f, h),
        "model.layers.1.mlp.experts.5.down_proj": (h, f),
    }.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(4, in_dim, generator=g) * 0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_dim, 4, generator=g) * 0.5
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    return path


def test_lora_adapter_changes_outputs_and_unloading_restores_them(server, models, tmp_path):
    adapter = _write_adapter(tmp_path / "adapter", models[0])
    prompts = [PROMPT, [9, 8, 7, 6], [100, 101]]

    async def go():
        async with EngineClient([server]) as client:
            base = [(await client.generate(p, GREEDY))[0].output_ids for p in prompts]
            await client.load_lora("a", str(adapter))
            # Mixed batch: requests with and without the adapter, concurrently.
            mixed = await asyncio.gather(
                *(client.generate(p, GREEDY, lora_path=lp) for p in prompts for lp in (None, "a"))
            )
            await client.unload_lora("a")
            after = [(await client.generate(p, GREEDY))[0].output_ids for p in prompts]
            status, answer = await _post_json(server, "/generate", {"input_ids": PROMPT, "lora_path": "a"})
            return base, [m[0].output_ids for m in mixed], after, status, answer

    base, mixed, after, status, answer = asyncio.run(go())
    plain, adapted = mixed[0::2], mixed[1::2]
    assert all(np.array_equal(a, b) for a, b in zip(base, plain, strict=True))
    assert any(not np.array_equal(a, b) for a, b in zip(base, adapted, strict=True))
    assert all(np.array_equal(a, b) for a, b in zip(base, after, strict=True))
    assert status == 400 and "not loaded" in answer["error"]["message"]


def test_lora_adapter_from_tensors_and_bad_adapters(server, models, tmp_path):
    from safetensors.torch import load_file

    adapter = _write_adapter(tmp_path / "adapter", models[0])
    tensors = load_file(adapter / "adapter_model.safetensors")
    config = json.loads((adapter / "adapter_config.json").read_text())

    async def go():
        async with EngineClient([server]) as client:
            (from_dir,) = await _load_and_generate(client, "d", lambda: client.load_lora("d", str(adapter)))
            (from_tensors,) = await _load_and_generate(
                client, "t", lambda: client.load_lora_from_tensors("t", config, tensors)
            )
            bad = await _post_json(
                server, "/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "missing")}
            )
            dup = await _post_json(server, "/load_lora_adapter", {"lora_name": "d", "lora_path": str(adapter)})
            return from_dir, from_tensors, bad, dup

    from_dir, from_tensors, bad, dup = asyncio.run(go())
    assert np.array_equal(from_dir.output_ids, from_tensors.output_ids)
    assert bad[0] == 400 and "PEFT format" in bad[1]["error"]["message"]
    assert dup[0] == 400 and "already loaded" in dup[1]["error"]["message"]


async def _load_and_generate(client, name, load):
    await load()
    return await client.generate(PROMPT, GREEDY, lora_path=name)


def test_the_server_reports_what_it_computes_in(server):
    """A job verifying engines given by URL bounds their log-prob deltas by the dtype they report (as SGLang's
    /server_info carries its --dtype), not by its own engines.dtype."""

    async def info():
        async with EngineClient([server]) as client:
            return await client.server_info()

    (reported,) = asyncio.run(info())
    assert reported["engine"] == "moerl-embedded" and reported["dtype"] == "float32"


def test_a_repeated_call_stands_on_the_engines_left_however_many_go_while_it_is_made(server, tmp_path):
    """Engines going one after another during a sync's control call (the second killed while the call is made again
    without the first): each attempt stands on the engines left, until one succeeds; none is lost from the sync."""
    import socket

    from moerl.weight_sync.disk import DiskSync

    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", 0)), second.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        gone = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in (first, second)]
        sync = DiskSync([server, *gone], tmp_path, tmp_path)
        client = sync.link.client
        # What /health finds after each failure: the second engine still answered when the first failure was looked at.
        health = iter([[True, False, True], [True, False, False]])

        async def healthy(paused=False):
            return next(health)

        client.healthy = healthy
        attempts = []

        def pause(client):
            attempts.append(list(client.targets))
            return client.pause("abort")

        try:
            client.targets = [server, *gone]
            sync.on_engines(pause)
            assert attempts == [[server, *gone], [server, gone[1]], [server]] and client.targets == [server]
            sync.link.run(client.resume())
        finally:
            sync.close()


def test_an_engine_started_again_while_a_call_waits_is_not_the_one_the_call_was_made_on(server, tmp_path):
    """A call fails on the engine an update chose, and the job starts that engine again before it answers (its process
    died): the process answering at the address now missed the update, so the call is not made on it as if it were
    still there (nor its failure raised). A repeated call stands on no engine; one of a push's last calls fails as
    EnginesDown, every chosen engine gone."""
    from moerl.engines.client import EngineError
    from moerl.errors import EnginesDown
    from moerl.weight_sync.base import EngineCall
    from moerl.weight_sync.disk import DiskSync

    sync = DiskSync([server], tmp_path, tmp_path)
    client = sync.link.client
    healthy = client.healthy

    async def restarted_meanwhile(paused=False):
        sync.started_again([server])  # as the job's revive, while the call waited for an engine
        return await healthy(paused)

    client.healthy = restarted_meanwhile
    attempts = []

    async def fails_on_the_process_that_died(client):
        attempts.append(list(client.targets))
        if client.targets:
            raise EngineError(server, "connection reset")
        return []

    try:
        for policy, raised in ((EngineCall.REPEATED, None), (EngineCall.REPEATED_ON_CHOSEN, EnginesDown)):
            client.targets, attempts = [server], []
            if raised is None:
                assert sync.on_engines(fails_on_the_process_that_died, policy) == []
                assert attempts == [[server], []]
            else:
                with pytest.raises(raised, match="none of the engines this update chose answers"):
                    sync.on_engines(fails_on_the_process_that_died, policy)
            assert client.targets == [] and sync.may_be_new == {server}
    finally:
        sync.close()


def test_a_paused_engine_is_not_healthy_yet_the_update_that_paused_it_still_finds_it(server, tmp_path):
    """As SGLang's, a paused engine's /health fails (its one-token generation waits for the pause). An update that
    looks for its engines while it has them paused (after a failed call) asks whether they answer instead, or every
    engine would seem gone and the run would stop after engines.down_timeout_s."""
    from moerl.errors import EnginesDown
    from moerl.weight_sync.disk import DiskSync

    sync = DiskSync([server], tmp_path, tmp_path)
    client = sync.link.client
    try:
        sync.link.run(client.pause("abort"))
        assert sync.link.run(client.healthy()) == [False]
        sync.down_timeout_s = 1
        with pytest.raises(EnginesDown, match="no engine answered /health for 1 s"):
            sync.choose_engines()
        sync.paused = True
        assert sync.choose_engines() == [server]
        sync.link.run(client.resume())
        assert sync.link.run(client.healthy()) == [True]
    finally:
        sync.close()


def test_a_verify_and_an_adapter_load_stand_on_the_engines_left_when_one_has_just_gone(server, models, tmp_path):
    """An engine gone (its port refusing) after an update chose it and before the next call on it: the probe that
    verifies the update, and an adapter's load, stand on the engine left, the gone one passed over (it takes the
    policy when it is back). The adapter is not loaded twice where it was loaded (the engine would refuse it), and a
    failure on an engine still there is still raised."""
    import socket

    from safetensors.torch import load_file

    from moerl.checkpoint.peft import AdapterFiles
    from moerl.megatron.lora_config import LoRAConfig
    from moerl.weight_sync.base import WeightSyncError, probe_ids
    from moerl.weight_sync.lora import AdapterSync

    adapter = _write_adapter(tmp_path / "adapter", models[0])
    files = AdapterFiles(
        json.loads((adapter / "adapter_config.json").read_text()), load_file(adapter / "adapter_model.safetensors")
    )
    hf_config = json.loads((models[0] / "config.json").read_text())
    ids = probe_ids(hf_config["vocab_size"])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
        sync = AdapterSync([server, gone], LoRAConfig(enabled=True), hf_config, str(models[0]))
        client = sync.link.client
        try:
            client.targets = [server]
            (ours,) = sync.link.run(client.prompt_logprobs(ids))

            def after_the_update_chose_both(call):
                client.targets = [server, gone]
                return call()

            worst = after_the_update_chose_both(lambda: sync.check_engines(ids, ours, "default", 1e-6))
            assert client.targets == [server] and worst["sync/verify_max_abs_delta"] == 0
            with pytest.raises(WeightSyncError, match=f"{server} does not serve"):
                after_the_update_chose_both(lambda: sync.check_engines(ids, ours + 0.1, "default", 1e-3))
            after_the_update_chose_both(lambda: sync.load("a", files))
            assert client.targets == [server]
            # the adapter is in use
            assert sync.check_engines(ids, ours, None, 10.0, "a")["sync/verify_max_abs_delta"] > 0
            with pytest.raises(
                WeightSyncError,
                match=rf"{server} does not serve the trainer's weights \(adapter a\).*start it again from model.path",
            ):
                sync.check_engines(ids, ours + 0.1, None, 1e-3, "a")
            with pytest.raises(EngineError, match="already loaded") as refused:
                after_the_update_chose_both(lambda: sync.load("a", files))
            assert refused.value.url == server
        finally:
            sync.close()


def test_a_broadcast_sessions_close_stands_on_the_engines_left_when_one_has_just_gone(server, tmp_path):
    """An engine gone after a broadcast's last bucket (before the session's end, or between the version and the flush):
    the session ends and the version is served on the engines left, the gone one passed over (and remembered, for the
    senders to form their groups again when it is back), rather than the push failing and the whole policy being
    pushed again. The end is not asked twice of an engine (it would refuse), a failure on an engine still there is
    raised whichever failed first, and with every engine it chose gone the close fails at once, as EnginesDown: it does
    not wait for one to be started again, which would be told the version without the weights."""
    import socket

    from moerl.errors import EnginesDown
    from moerl.weight_sync.broadcast import BroadcastSync

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
        sync = BroadcastSync([server, gone], "127.0.0.1", "gloo")
        client = sync.link.client
        client.backoff_s = 0.01
        flush = client.flush_cache
        try:
            client.targets = [server]
            sync.link.run(client.begin_weight_update())
            client.targets = [server, gone]  # the update chose both; the gone one went after the last bucket
            sync._close_session("7")
            assert client.targets == [server] and sync.link.run(client.weight_versions()) == ["7"]
            assert sync.may_be_new == {gone}

            async def flush_as_one_goes():
                client.flush_cache = flush
                client.targets = [server, gone]
                return await flush()

            sync.link.run(client.begin_weight_update())  # refused unless the close ended the session
            client.flush_cache = flush_as_one_goes
            sync._close_session("8")
            assert client.targets == [server] and sync.link.run(client.weight_versions()) == ["8"]
            call = client._call

            async def server_answers_last(url, route, *args, **kwargs):
                if url == server:
                    await asyncio.sleep(0.5)  # the gone engine's refused connection comes back first
                return await call(url, route, *args, **kwargs)

            client._call = server_answers_last
            for targets in ([server], [gone, server]):
                client.targets = targets
                with pytest.raises(EngineError, match="no weight-update session is open") as refused:
                    sync._close_session("9")
                assert refused.value.url == server
            client._call = call

            async def none_answers(paused=False):
                return [False, False]

            client.healthy = none_answers  # waiting, choose_engines would start the engines again (while_down)
            sync.while_down = lambda: pytest.fail("the close waited for an engine")
            client.targets = [server, gone]
            with pytest.raises(EnginesDown, match="none of the engines this update chose answers any more"):
                sync._close_session("10")
            client.targets = [server]
            assert sync.link.run(client.weight_versions()) == ["8"]
        finally:
            sync.close()


def test_a_replica_that_lost_the_runs_policy_unseen_fails_the_request_and_leaves_rotation(server):
    """A replica restarted between two probes, or after a request chose it, holds what it started with: it answers
    under its own weight version ("default", not one a sync of the run left), or refuses the adapter a sync loaded
    there. Either way the request fails as the replica's (to be re-issued elsewhere, never trained on) and the replica
    is stale until a sync reaches it; another 4xx is still the request's own error."""
    from moerl.engines.client import ReplicaDown
    from moerl.engines.health import State

    async def go():
        async with EngineClient([server], retries=0) as client:
            health = client.health
            health.sync_reached("3", [server])  # the run's last sync left policy 3 there, before the engine restarted
            with pytest.raises(ReplicaDown, match="weight version 'default'"):
                await client.generate(PROMPT, GREEDY)
            assert health.state(server) is State.STALE
            health.probed(server, True, "default")
            assert health.state(server) is State.STALE  # answering is not enough: a sync must reach it

            await client.set_weight_version("3")  # the catch-up sync
            health.sync_reached("3", [server])
            health.probed(server, True, "3")
            (done,) = await client.generate(PROMPT, GREEDY)
            assert done.weight_versions[0]["version"] == "3" and health.state(server) is State.HEALTHY

            health.sync_reached(None, [server])  # a LoRA run's: the adapter names the policy
            with pytest.raises(EngineError) as bad:  # the request's own fault, whatever adapter it names
                await client.generate([10**6], GREEDY, lora_path="moerl-lora-v3")
            assert (
                bad.value.status == 400
                and not isinstance(bad.value, ReplicaDown)
                and health.state(server) is State.HEALTHY
            )
            with pytest.raises(ReplicaDown, match="has never been loaded"):
                await client.generate(PROMPT, GREEDY, lora_path="moerl-lora-v3")
            assert health.state(server) is State.STALE
            health.sync_reached(None, [server])
            health.probed(server, True, "3")
            with pytest.raises(EngineError) as bad:
                await client.generate([10**6], GREEDY)  # past the vocabulary
            assert (
                bad.value.status == 400
                and not isinstance(bad.value, ReplicaDown)
                and health.state(server) is State.HEALTHY
            )

    asyncio.run(go())
