"""Weight export for engine sync: at any layout, the stream is the HF checkpoint, bitwise."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from moerl.checkpoint.hf import HFReader
from moerl.layout import Layout
from moerl.megatron.launch import run_ranks
from tests.conftest import ARCHS
from tests.workers import export_hf


@pytest.mark.e2e
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "world, layout",
    [(2, Layout(tp=2)), (2, Layout(ep=2)), (2, Layout(pp=2)), (4, Layout(tp=2, ep=2, pp=2))],
    ids=["TP2", "EP2", "PP2", "TP2xEP2xPP2"],
)
def test_export_streams_the_hf_checkpoint_bitwise_to_rank_0_or_split_across_the_senders(
    tiny_ckpts, arch, world, layout
):
    hf_dir, mcore_dir = tiny_ckpts[arch]
    reader = HFReader(hf_dir)
    ranks = run_ranks(export_hf, world, str(mcore_dir), layout)
    stream = ranks[0]["stream"]
    names = [name for name, _ in stream]
    assert sorted(names) == sorted(reader.names()) and len(set(names)) == len(names)
    for name, tensor in stream:
        assert torch.equal(tensor, reader.get(name)), name

    def nbytes(names):
        return sum(reader.get(n).numel() * reader.get(n).element_size() for n in names)

    model_bytes = nbytes(reader.names())
    assert 0 < ranks[0]["received"] < model_bytes
    for rank, out in enumerate(ranks[1:], start=1):
        assert out["stream"] == []  # only rank 0 sends to the engines
        if not out["lead"]:
            assert out["received"] == 0, rank  # it only sends its shards
            continue
        # A later stage's first rank takes in less than its own stage's tensors: its TP and EP peers' shards.
        stage = [
            n
            for n in reader.names()
            if (int(n.split(".")[2]) in out["layers"] if n.startswith("model.layers.") else out["last"])
        ]
        assert out["received"] < nbytes(stage), rank
        assert (out["received"] > 0) == (layout.tp > 1 or layout.ep > 1), rank

    # Several senders: together their shares are the checkpoint, bitwise, each tensor once; a sender takes in only
    # its TP peers' shards of what it sends (experts are not gathered across EP ranks), any other rank nothing.
    shares = [(name, tensor) for out in ranks for name, tensor in out["share"]]
    assert sorted(name for name, _ in shares) == sorted(reader.names())
    for name, tensor in shares:
        assert torch.equal(tensor, reader.get(name)), name
    assert sum(out["sends"] for out in ranks) == layout.pp * layout.ep
    for rank, out in enumerate(ranks):
        assert bool(out["share"]) == out["sends"], rank
        # At most the other half of what it sends (norms and routers are replicated; experts at ETP1 not sharded).
        assert out["share_received"] <= nbytes(name for name, _ in out["share"]) // 2, rank
        if layout.tp == 1 or not out["sends"]:
            assert out["share_received"] == 0, rank
        else:  # the TP-sharded dense tensors are spread over the senders of a TP group, not all sent by its first
            assert out["share_received"] > 0, rank
    assert (ranks[0]["share_received"] > 0) == (layout.tp > 1)


@pytest.mark.e2e
def test_expert_tp_shards_are_joined_by_their_layer_not_by_the_partition_dim_te_marks(tiny_ckpts):
    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    reader = HFReader(hf_dir)
    ranks = run_ranks(export_hf, 2, str(mcore_dir), Layout(tp=2), True)  # expert TP 2
    stream = ranks[0]["stream"]
    shares = [named for rank in ranks for named in rank["share"]]
    for exported in (stream, shares):
        assert sorted(name for name, _ in exported) == sorted(reader.names())
        for name, tensor in exported:
            assert tensor.shape == reader.get(name).shape and torch.equal(tensor, reader.get(name)), name
    assert any(name.endswith("experts.0.down_proj.weight") for name, _ in stream)


@pytest.mark.e2e
@pytest.mark.parametrize("layout", [{"ep": 2}, {"pp": 2}], ids=["EP2", "PP2"])
def test_after_a_broadcast_sync_every_engine_holds_the_trainers_weights_bitwise(tiny_ckpts, tmp_path, layout):
    from moerl.trainer.config import OptimConfig, TrainerConfig
    from tests.engine_server import running_servers
    from tests.trainer.test_trainer import rollout
    from tests.workers import train_then_sync

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    samples = rollout(hf_dir, torch.float32)
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-2), **layout)
    with running_servers(hf_dir, tmp_path / "logs", 2) as urls:
        ranks = run_ranks(train_then_sync, 2, str(mcore_dir), cfg, samples, urls)
    # SGLang takes one update at a time, in the order they reach it: every engine must take the senders' buckets in
    # one order, or each of two waits in a broadcast the other has not reached.
    orders = [
        re.findall(r"from weight group (\S+)", log.read_text()) for log in sorted((tmp_path / "logs").glob("*.log"))
    ]
    assert len(orders) == 2 and orders[0] == orders[1] and len(orders[0]) > 2 and len(set(orders[0])) == 2
    out = ranks[0]
    reader = HFReader(hf_dir)
    stats = out["stats"]
    assert stats.buckets > 1 and stats.tensors == len(reader.names())
    # Both ranks send, each over a group of its own: each stage its own layers (PP2), each EP rank its own experts
    # (EP2). Without TP nothing is gathered at all: no rank takes in another's weights.
    assert len({r["group"] for r in ranks}) == 2 and None not in {r["group"] for r in ranks}
    assert all(r["sent"].bytes > 0 for r in ranks) and sum(r["sent"].bytes for r in ranks) == stats.bytes
    assert sum(r["sent"].tensors for r in ranks) == stats.tensors
    assert [r["received"] for r in ranks] == [0, 0]
    assert out["versions"] == ["1", "1"]  # the policy version after one step
    changed = 0
    for name, tensor in out["trained"]:
        assert all(torch.equal(torch.tensor(served, dtype=tensor.dtype), tensor) for served in out["served"][name]), (
            name
        )
        changed += not torch.equal(tensor, reader.get(name))
    assert changed > len(out["trained"]) // 2  # the step moved the weights the engine now serves


@pytest.mark.e2e
def test_a_second_run_joins_the_engines_the_first_left(tiny_ckpts, tmp_path):
    from moerl.weight_sync.broadcast import BroadcastSync
    from tests.engine_server import running_server

    hf_dir, _ = tiny_ckpts["Qwen3MoeForCausalLM"]
    with running_server(hf_dir, tmp_path / "logs") as url:
        names = []
        for _ in range(2):  # the engine outlives the first: a resumed run given engines.urls
            sync = BroadcastSync([url], "127.0.0.1", "gloo")
            sync.connect()
            names.append(sync.group_name)
            sync.close()
    assert names[0] != names[1]


@pytest.mark.e2e
def test_a_broadcast_is_waited_for_only_once_the_engines_took_it_and_a_refused_ones_group_is_aborted(
    tiny_ckpts, tmp_path, monkeypatch
):
    """Under NCCL a broadcast's wait makes the device's stream wait: one for a bucket no engine joins would hold every
    later kernel and collective of the rank. So a bucket is waited for only after the engines answered, and a refused
    one's group is aborted and dropped, with the engine's error, even when the refusal comes back before the broadcast
    is enqueued. A group formed again aborts the one it replaces, and closing the sync its last: aborted, not destroyed
    (NCCL's destroy is collective with the engines)."""
    import time

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    from moerl.engines.client import EngineError
    from moerl.weight_sync.broadcast import BroadcastSync
    from tests.engine_server import running_server, weights_by_name

    broadcast, events, enqueue_after = dist.broadcast, [], [0.0]

    class Recorded:
        def __init__(self, work, bucket):
            self.work, self.bucket = work, bucket

        def wait(self):
            events.append(("wait", self.bucket))
            return self.work.wait()

    def recorded_broadcast(tensor, src, group, async_op=False):
        time.sleep(enqueue_after[0])
        events.append(("broadcast", tensor.numel(), async_op))
        return Recorded(broadcast(tensor, src, group, async_op), tensor.numel())

    monkeypatch.setattr(dist, "broadcast", recorded_broadcast)
    monkeypatch.setattr(dist.ProcessGroup, "abort", lambda group: events.append(("abort",)))
    hf_dir, _ = tiny_ckpts["Qwen3MoeForCausalLM"]
    hidden = HFReader(hf_dir).get("model.norm.weight").numel()
    with running_server(hf_dir, tmp_path / "logs") as url:
        sync = BroadcastSync([url], "127.0.0.1", "gloo")
        sync.connect()
        announce = sync.sender.client.update_weights_from_distributed

        async def announced(*args, **kwargs):
            try:
                return await announce(*args, **kwargs)
            finally:
                events.append(("answered",))

        sync.sender.client.update_weights_from_distributed = announced
        sync.push([("model.norm.weight", torch.full((hidden,), 0.5))], "1")
        assert events == [("broadcast", 4 * hidden, True), ("answered",), ("wait", 4 * hidden)]
        for delay in (0.0, 1.0):  # the engine refuses before it receives a byte; a second after it, the enqueue returns
            events.clear()
            enqueue_after[0] = delay
            with pytest.raises(EngineError, match="experts.999"):
                sync.push([("model.layers.0.mlp.experts.999.gate_proj.weight", torch.zeros(3, 4))], "2")
            deadline = time.monotonic() + 10
            while ("abort",) not in events and time.monotonic() < deadline:  # a late enqueue aborts in its thread
                time.sleep(0.05)
            enqueued, answered = ("broadcast", 48, True), ("answered",)
            assert events in ([enqueued, answered, ("abort",)], [answered, enqueued, ("abort",)]) and (
                delay == 0 or events[0] == answered
            )
            assert sync.group is None
            sync.link.run(sync.link.client.abandon_weight_update())
            sync._form_group([url])
        events.clear()
        replaced = sync.group
        sync._form_group([url])  # a push made again: the group it replaces leaves this side's device
        # and the registry: at exit the job destroys every group it holds, which NCCL makes a collective with the
        # engines
        assert events == [("abort",)] and replaced not in _world.pg_map
        current = sync.group
        sync.close()
        assert events == [("abort",), ("abort",)] and current not in _world.pg_map
        enqueue_after[0] = 0.0
        again = BroadcastSync([url], "127.0.0.1", "gloo")  # the engine serves on and takes a new group's updates
        again.connect()
        again.push([("model.norm.weight", torch.full((hidden,), 0.25))], "3")
        served = asyncio.run(weights_by_name(url, "model.norm.weight"))
        again.close()
    assert torch.equal(torch.tensor(served), torch.full((hidden,), 0.25))


@pytest.mark.e2e
def test_a_sender_that_fails_ends_every_senders_turns_and_the_push_made_again_reaches_the_engines(tiny_ckpts, tmp_path):
    """An engine that took a failed sender's announcement waits in its broadcast for good, and each later sender's
    would wait behind it to its deadline: after one sender fails no sender sends, and the push is made once more. Every
    sender forms its group again where an engine a call passed over is chosen again: it may be a new process."""
    from moerl.trainer.config import TrainerConfig
    from tests.engine_server import running_servers
    from tests.workers import sync_with_a_sender_failing_once

    _, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    with running_servers(tiny_ckpts["Qwen3MoeForCausalLM"][0], tmp_path / "logs", 2) as urls:
        ranks = run_ranks(sync_with_a_sender_failing_once, 2, str(mcore_dir), TrainerConfig(ep=2), urls)
    first, second = ranks[0]["turns"], ranks[1]["turns"]
    assert second.count(1) == 1 and first.count(1) == 1  # both had a turn in the first round, then none
    assert first.count(2) >= 2 and second.count(2) >= 2  # a whole push takes several rounds
    assert ranks[0]["versions"] == [ranks[0]["version"]] * 2
    assert ranks[0]["groups"] == ranks[1]["groups"] == [2, 3]  # at connect and for the push made again; then once more


@pytest.mark.e2e
def test_engines_a_failed_bucket_may_have_wedged_are_restarted_or_left_out_never_pushed_to_again(tiny_ckpts, tmp_path):
    """SGLang answers a bucket before its GPU has the bytes, and an engine that took one whose broadcast then failed (a
    peer refused it, or died) waits in NCCL for good while its HTTP process answers on. After such a failure the push is
    made again without them: the job restarts those it started (the push then reaches the new process), and one given by
    URL is left out; with none left the update stops at once with EnginesDown, not after engines.down_timeout_s. On gloo
    nothing wedges: this is the mechanism, on engines that would."""
    from moerl.models.tiny import save_tiny_hf
    from moerl.trainer.config import TrainerConfig
    from tests.engine_server import running_server
    from tests.workers import syncs_where_one_engine_refuses_a_bucket_the_other_took

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    other_vocab = save_tiny_hf("Qwen3MoeForCausalLM", tmp_path / "other-vocab", vocab_size=300)
    with running_server(other_vocab, tmp_path / "logs") as refusing:
        out = run_ranks(
            syncs_where_one_engine_refuses_a_bucket_the_other_took,
            1,
            str(mcore_dir),
            TrainerConfig(),
            str(hf_dir),
            refusing,
            str(tmp_path / "pool-logs"),
        )[0]
    started = out["started"]
    assert out["wedged"] == [sorted([started, refusing])] * 2
    assert out["first"] and out["targets"] == [started] and out["versions"] == ["0"] and out["restarts"] == {0: 1}
    both, first = [started, refusing], out["first_announced"]
    tried = first.index([started])  # buckets announced to both, up to the embedding's, which one refused
    assert tried > 0 and first[:tried] == [both] * tried
    assert all(targets == [started] for targets in first[tried:])  # then the whole push to the restarted engine alone
    assert "took part in a weight broadcast that failed" in out["second"] and out["second_seconds"] < 60
    assert out["announced"] == [both] * tried  # the second update: the same buckets, and the push not made again


def test_replicas_the_job_starts_again_are_new_processes_to_the_next_push(tmp_path):
    """A replica the job starts again at its address is outside the broadcast's groups, though the engines chosen may
    read the same: the sync is told, so that its senders form their groups again (the test above), and a call waiting
    for an engine does not take the new process for the one it was made on (test_engine_control)."""
    from types import SimpleNamespace

    from moerl.orchestrator.lead import Lead
    from moerl.weight_sync.disk import DiskSync

    told = []
    lead = SimpleNamespace(
        engines=SimpleNamespace(pool=SimpleNamespace(revive=lambda most, window: ["http://b"]), scorers={}),
        cfg=SimpleNamespace(engines=SimpleNamespace(max_restarts=3, restart_window_s=3600.0)),
        rollouts=SimpleNamespace(restarting=told.append),
        sync=DiskSync(None, tmp_path, tmp_path),
    )
    lead.sync.may_be_new = {"http://a"}
    Lead.revive(lead)
    Lead.revive(lead)
    assert lead.sync.may_be_new == {"http://a", "http://b"} and told == [["http://b"]] * 2
    assert lead.sync.starts == {"http://b": 2}


@pytest.mark.e2e
@pytest.mark.parametrize("failure", ["engines_down", "other"])
def test_a_step_rank_0_takes_alone_that_fails_there_stops_every_rank_with_its_error(failure):
    """Global rank 0 talks to the engines alone; whatever fails there must reach the other ranks, which otherwise wait
    in a collective rank 0 never joins (under NCCL until its timeout; under gloo until rank 0's group closes, when they
    fail with a connection error). Engines gone: every rank raises EnginesDown (the job checkpoints on each); anything
    else: rank 0 its own error, the others one pointing to it."""
    from tests.workers import what_each_rank_raises_when_rank_0_fails_an_agreed_step

    (kind0, message0, relayed0), (kind1, message1, relayed1) = run_ranks(
        what_each_rank_raises_when_rank_0_fails_an_agreed_step, 2, failure, timeout_s=120
    )
    if failure == "engines_down":
        assert (kind0, kind1) == ("EnginesDown", "EnginesDown") and message0 == "no engine answered"
    else:
        assert (kind0, kind1) == ("WeightSyncError", "MoerlError") and message0 == "an engine does not serve it"
        assert "global rank 0 failed in the weight sync" in message1
    assert not relayed0 and relayed1  # only rank 0 prints its error


def test_an_engine_holding_all_the_weight_groups_it_may_is_restarted_or_left_out():
    """An engine keeps every weight group it joins, a communicator per sender outside mem_fraction_static: where the
    senders would form their groups again, one holding MAX_GROUPS_PER_ENGINE of the run's is restarted if the job
    started
    it (a new process holds none) and otherwise left out for the rest of the run; with none left the push stops."""
    from moerl.engines.weight_group import MAX_GROUPS_PER_ENGINE
    from moerl.errors import EnginesDown
    from moerl.weight_sync.broadcast import BroadcastSync

    started, given, other = "http://started", "http://given", "http://other"
    sync = BroadcastSync([started, given, other], "127.0.0.1", "gloo")
    try:
        client, told = sync.link.client, []
        sync.restart_engines = lambda urls: told.append(urls) or [url for url in urls if url == started]

        def regroup(targets, new=()):
            # as after a failed push: every sender forms its group again
            client.targets, sync.members = list(targets), []
            chosen = sync._members(set(new))
            sync.members = chosen[0]
            return chosen

        for _ in range(MAX_GROUPS_PER_ENGINE):
            assert regroup([started, given]) == ([started, given], False)
        sync.members = [started, given]
        client.targets = [started, given]
        assert sync._members(set()) == ([started, given], False) and not told  # no group formed: nothing counted
        assert regroup([started, given, other], new=[other]) == ([other], True)
        assert told == [[started, given]] and sync.may_be_new == {started} and sync.retired == {given}
        assert regroup([started, other], new=[started]) == ([started, other], True)  # restarted: it holds none

        async def all_answer(paused=False):
            return [True, True, True]

        client.healthy = all_answer
        assert sync.choose_engines() == [started, other]  # the engine given by URL is not chosen again
        assert sync.groups_held == {started: 1, given: MAX_GROUPS_PER_ENGINE, other: 2}
        sync.groups_held.update({started: MAX_GROUPS_PER_ENGINE, other: MAX_GROUPS_PER_ENGINE})
        sync.restart_engines = None
        with pytest.raises(EnginesDown, match="holds 4 weight groups of this run"):
            regroup([started, other])
    finally:
        sync.close()


@pytest.mark.e2e
def test_engines_on_another_torch_than_the_trainer_are_refused_before_a_nccl_group_forms(
    tiny_ckpts, tmp_path, monkeypatch
):
    """Each torch bundles its NCCL, and one communicator of two NCCL releases fails or hangs: SGLang 0.5.23 pins torch
    2.14.1. Where the weight sync would form NCCL groups, an engine on another torch is refused at connect with what to
    align; over gloo it does not matter."""
    from moerl.errors import ConfigError
    from moerl.weight_sync import broadcast
    from moerl.weight_sync.broadcast import BroadcastSync, torch_mismatch
    from tests.engine_server import running_server

    sglang = {"tp_size": 2, "version": "0.5.23"}
    assert torch_mismatch(["http://a"], [sglang], "2.14.1+cu130") is None
    assert torch_mismatch(
        ["http://a", "http://b"],
        [sglang, {"tp_size": 1, "version": "0.1.0", "torch_version": "2.11.0+cu130"}],
        "2.11.0",
    ) == (
        "a NCCL weight group needs one NCCL release on both sides, and torch bundles its own: "
        "http://a runs torch 2.14.1, which SGLang 0.5.23 pins, this trainer torch 2.11.0: "
        "install torch==2.14.1 for the trainer, or set sync.method=disk"
    )
    # a release it does not know
    assert torch_mismatch(["http://a"], [{"tp_size": 1, "version": "0.9.9"}], "2.11.0") is None

    monkeypatch.setattr(broadcast.torch, "__version__", "2.11.0+cu130")  # the trainer's; the engine reports its own
    with running_server(tiny_ckpts["Qwen3MoeForCausalLM"][0], tmp_path) as url:
        sync = BroadcastSync([url], "127.0.0.1", "nccl")
        try:
            with pytest.raises(
                ConfigError, match=rf"{url} runs torch 2\.13\.0, this trainer torch 2\.11\.0: install torch==2\.13\.0"
            ):
                sync.connect()
            assert sync.group is None
        finally:
            sync.close()


@pytest.mark.e2e
def test_a_colocated_push_hands_each_engine_the_bucket_from_the_rank_on_its_gpu(tiny_ckpts, tmp_path):
    """Colocated, engine k runs on the GPU of the trainer rank of local rank k, and CUDA IPC maps only memory of a GPU
    the engine sees: every bucket is copied to each such rank, and each engine is posted the handle its own rank made.
    After one step both engines hold the trainer's weights bitwise."""
    from moerl.trainer.config import OptimConfig, TrainerConfig
    from tests.engine_server import running_servers
    from tests.trainer.test_trainer import rollout
    from tests.workers import train_then_hand_over

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    samples = rollout(hf_dir, torch.float32)
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-2), ep=2)
    with running_servers(hf_dir, tmp_path / "logs", 2) as urls:
        ranks = run_ranks(train_then_hand_over, 2, str(mcore_dir), cfg, samples, urls)
    out = ranks[0]
    assert out["ranks"] == [0, 1] and out["stats"].buckets == len(out["posted"]) > 1
    made = [set(rank["made"]) for rank in ranks]
    assert all(len(rank["made"]) == len(out["posted"]) for rank in ranks)  # a copy of each bucket on each rank
    for handles in out["posted"]:
        assert handles[0] in made[0] and handles[1] in made[1]
    reader = HFReader(hf_dir)
    assert out["stats"].tensors == len(reader.names()) and out["versions"] == ["1", "1"]
    changed = 0
    for name, tensor in out["trained"]:
        for served in out["served"][name]:
            assert torch.equal(torch.tensor(served, dtype=tensor.dtype), tensor), name
        changed += not torch.equal(tensor, reader.get(name))
    assert changed > len(out["trained"]) // 2  # the step moved the weights the engines now serve


@pytest.mark.e2e
def test_a_colocated_push_that_fails_mid_way_stops_every_rank_none_left_in_a_gather(tiny_ckpts, tmp_path):
    """Rank 0 sends each bucket as the layers are gathered; when one fails it still takes the remaining gathers, which
    the other ranks make, and only then raises: every rank stops with the failure, where rank 1 waited for good. Where
    the failure is the engine's death (SIGKILL after the first bucket), the push reaches no engine and the update ends
    on every rank without an error, the trainer's weights off the device as after any push: the job starts the engine
    again, and a catch-up brings it the policy."""
    from moerl.trainer.config import TrainerConfig
    from tests.engine_server import running_server
    from tests.workers import tensor_push_failing_after_a_bucket

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    with running_server(hf_dir, tmp_path / "logs") as url:
        ranks = run_ranks(
            tensor_push_failing_after_a_bucket, 2, str(mcore_dir), TrainerConfig(ep=2), url, timeout_s=120
        )
    assert ranks[0]["sent"] == 2 and ranks[1]["sent"] == 0
    assert ranks[0]["raised"] == "RuntimeError: a planted failure after one bucket"
    assert "global rank 0 failed in the weight sync" in ranks[1]["raised"]
    assert all(rank["on_device"] for rank in ranks)
    with running_server(hf_dir, tmp_path / "logs2") as url:
        ranks = run_ranks(
            tensor_push_failing_after_a_bucket, 2, str(mcore_dir), TrainerConfig(ep=2), url, True, timeout_s=120
        )
    assert [rank["raised"] for rank in ranks] == [None, None] and ranks[0]["engines"] == []
    assert ranks[0]["sent"] == 2 and not any(rank["on_device"] for rank in ranks)


def test_a_sleep_that_fails_on_one_engine_leaves_those_it_released_asleep_for_the_update():
    """Colocated: one engine refuses to release its memory. Those that released it are asleep: the update gives them
    their weights back before it pushes (it never pushes into released weights) and resumes each tag it released once;
    the one that refused holds its memory and is asked to resume nothing (SGLang's scheduler dies on a resume of a tag
    it did not release). Release was asked once of each (SGLang stashes the released weights' state again on a
    second)."""
    import threading

    from aiohttp import web

    from moerl.engines.client import EngineError
    from moerl.weight_sync.tensor import TensorSync
    from tests.engine_server import serving

    calls: dict[str, list] = {"ok": [], "refuses": []}

    def engine(name: str):
        async def record(request):
            body = await request.json() if request.can_read_body else None
            calls[name].append((request.path, body))
            if request.path == "/release_memory_occupation" and name == "refuses":
                return web.json_response({"error": {"message": "release failed"}}, status=500)
            return web.json_response({"weight_version": "0"})

        return {(method, path): record for method, path in (("POST", "/pause_generation"),
                ("POST", "/release_memory_occupation"), ("POST", "/resume_memory_occupation"),
                ("POST", "/continue_generation"), ("GET", "/model_info"), ("GET", "/health"))}  # fmt: skip

    loop, urls, up = asyncio.new_event_loop(), {}, threading.Event()
    stop = asyncio.Event()

    async def serve_both():
        async with serving(engine("ok")) as ok, serving(engine("refuses")) as refuses:
            urls.update(ok=ok, refuses=refuses)
            up.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve_both(),), daemon=True)
    thread.start()
    up.wait(30)
    sync = TensorSync([urls["ok"], urls["refuses"]])
    try:
        with pytest.raises(EngineError, match="release failed"):
            sync.sleep()
        assert sync.asleep and sync.released == {urls["ok"]}
        sync.before_push()
        sync.after_push()
        assert not sync.asleep and sync.released == set()
    finally:
        sync.close()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)

    def asked(name: str, path: str) -> list:
        return [body for p, body in calls[name] if p == path]

    assert len(asked("ok", "/release_memory_occupation")) == len(asked("refuses", "/release_memory_occupation")) == 1
    assert asked("ok", "/resume_memory_occupation") == [{"tags": ["weights"]}, {"tags": ["kv_cache", "cuda_graph"]}]
    assert asked("refuses", "/resume_memory_occupation") == []
    assert asked("ok", "/continue_generation") and asked("refuses", "/continue_generation")


@pytest.mark.e2e
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_delta_pushes_leave_the_engines_holding_bitwise_what_a_full_push_would(tiny_ckpts, tmp_path, quantization):
    """The trainer's fp32 step moves nearly every weight, but only some of their values in the engines' bf16 (and fewer
    of their FP8 ones): each push sends those alone, and the engines end holding every tensor as a full push leaves it
    (the trainer's, cast to bf16; an FP8 weight as moerl.fp8 quantizes it). An engine that may be a new process gets
    every tensor whole."""
    from moerl.checkpoint.hf import save_fp8
    from moerl.engines.pool import EnginePool, EnginePoolConfig
    from moerl.trainer.config import OptimConfig, TrainerConfig
    from tests.trainer.test_trainer import rollout
    from tests.workers import push_deltas

    hf_dir, mcore_dir = tiny_ckpts["Qwen3MoeForCausalLM"]
    samples = rollout(hf_dir, torch.float32)
    served_dir = save_fp8(hf_dir, tmp_path / "fp8") if quantization == "fp8" else hf_dir
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-4), ep=2)
    engines = EnginePoolConfig(
        model_path=str(served_dir), server="embedded", base_port=0, dtype="bfloat16", replicas=2, log_dir=str(tmp_path)
    )
    with EnginePool(engines) as pool:
        ranks = run_ranks(push_deltas, 2, str(mcore_dir), cfg, samples, pool.urls, str(served_dir), quantization)
    out = ranks[0]
    first, second, after_restart = out["pushes"]
    for push in (first, second):
        assert not push.whole and 0 < push.changed < push.elements / 2
        assert 0 < push.bytes < push.full_bytes / 2  # positions or masks and values, not the tensors
    assert after_restart.whole and after_restart.changed == after_restart.elements
    assert after_restart.bytes == after_restart.full_bytes
    assert out["versions"] == ["3", "3"]
    names = {name for name, _ in out["trained"]}
    assert any(name.endswith("_scale_inv") for name in names) == (quantization == "fp8")
    for name, tensor in out["trained"]:
        held = tensor if tensor.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv") else tensor.bfloat16()
        for served in out["served"][name]:
            assert torch.equal(torch.tensor(served, dtype=torch.float32).to(held.dtype), held), name


def test_a_delta_push_never_splits_a_tensors_encoding_across_buckets():
    """The engine's loader decodes each bucket alone: a delta's shape, positions and values travel together, however
    small the buckets, and a tensor that sent nothing takes no room."""
    from moerl.engines.delta import decode, encode
    from moerl.weight_sync.delta import whole_encodings

    g = torch.Generator().manual_seed(0)
    encodings = []
    for i in range(6):
        before = torch.randn(256, 256, generator=g).bfloat16()
        after = before.clone()
        after.view(-1)[torch.randperm(before.numel(), generator=g)[: 256 * 26 * (i % 3)]] += 1  # 0%, 10%, 20% changed
        encodings.append(encode(f"w{i}", before, after).named)
    assert [] in encodings and any(len(named) == 3 for named in encodings)
    sent = list(whole_encodings(encodings, 64 << 10))
    assert len(sent) > 1 and all(bucket for bucket in sent)
    assert [pair for bucket in sent for pair in bucket] == [pair for named in encodings for pair in named]
    for bucket in sent:
        decode(bucket)  # raises where a delta's parts were split
