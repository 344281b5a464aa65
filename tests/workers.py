"""Per-rank bodies of the multi-rank tests (importable by spawned processes)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moerl.checkpoint.mcore import load_megatron_model
from moerl.layout import Layout
from moerl.megatron.forward import forward_logits, run_schedule
from moerl.megatron.parallel import collective_device
from moerl.megatron.weights import Gather

# What this process was started with, before any of its code ran (the spawned ranks import this module first).
CUDA_VISIBLE_AT_START = os.environ.get("CUDA_VISIBLE_DEVICES")


def adam_steps_after_a_shared_step_is_loaded(mcore_dir: str, trainer_cfg, samples: list) -> list[float]:
    """One step; then every parameter's Adam step set to one shared tensor, as megatron-core's DistributedOptimizer
    (without Apex or TE) loads it, and what the trainer does after a load; one more step. Each parameter's step
    after."""
    from moerl.trainer.trainer import Trainer, _inner_optimizers, _own_adam_steps

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.step(samples)
    shared = torch.tensor(1.0)
    for inner in _inner_optimizers(trainer.optimizer):
        for state in inner.state.values():
            state["step"] = shared
    _own_adam_steps(trainer.optimizer)
    trainer.step(samples)
    return [state["step"].item() for inner in _inner_optimizers(trainer.optimizer) for state in inner.state.values()]


def cuda_visible_at_start() -> str | None:
    return CUDA_VISIBLE_AT_START


def adam_steps_before_loading(mcore_dir: str, trainer_cfg) -> dict:
    """A fresh trainer's optimizer readied for a checkpoint load: megatron-core's DistributedOptimizer (without Apex
    or Transformer Engine) then asserts every parameter's Adam state holds one common ``step``."""
    from moerl.trainer.trainer import Trainer, _adam_state_before_loading, _inner_optimizers

    trainer = Trainer(mcore_dir, trainer_cfg)
    inners = _inner_optimizers(trainer.optimizer)
    fresh = sum(len(inner.state) for inner in inners)
    _adam_state_before_loading(trainer.optimizer)
    states = [inner.state.get(p) for inner in inners for g in inner.param_groups for p in g["params"]]
    return {
        "fresh": fresh,
        "params": len(states),
        "steps": sorted({s["step"].item() for s in states if s and "step" in s}),
        "with_state": sum(1 for s in states if s and "step" in s),
        "moments_zero": all(
            torch.count_nonzero(s["exp_avg"]) == 0 and torch.count_nonzero(s["exp_avg_sq"]) == 0 for s in states if s
        ),
    }


def full_tensors(model, grads: bool = False) -> dict[str, torch.Tensor] | None:
    """The whole model's parameters (or gradients) under TP1/EP1/PP1 names on global rank 0, None on the other
    ranks: gathered as the weight export gathers them, then brought to the CPU, where the tests compare."""
    full = Gather(model, grads=grads).gather()
    return None if full is None else {name: tensor.cpu() for name, tensor in full.items()}


def next_token_loss(vocab_parallel_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; vocab-parallel so it works at any TP."""
    logits = vocab_parallel_logits[:, :-1].transpose(0, 1).contiguous().float()  # [s-1, b, V/tp]
    labels = input_ids[:, 1:].transpose(0, 1).contiguous().to(logits.device)
    return vocab_parallel_cross_entropy(logits, labels).mean()


def parity(mcore_dir: str, layout: Layout, input_ids: torch.Tensor, config_overrides: dict) -> dict:
    """Logits, routing record/replay outcomes and full gradients of the fixed loss at ``layout``."""
    cfg, model = load_megatron_model(mcore_dir, layout, **config_overrides)
    logits = forward_logits(model, input_ids)
    out: dict = {"logits": None if logits is None else logits.cpu()}

    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    recorded_logits = forward_logits(model, input_ids)
    recorded = [t.clone() for t in RouterReplay.get_recorded_data()]
    RouterReplay.clear_global_indices()
    out["routers"] = len(recorded)

    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    RouterReplay.set_replay_data(recorded)
    replayed = forward_logits(model, input_ids)
    RouterReplay.clear_global_indices()
    forced = [(t + 1) % cfg["num_experts"] for t in recorded]
    RouterReplay.set_replay_data(forced)
    forced_logits = forward_logits(model, input_ids)
    RouterReplay.clear_global_indices()
    RouterReplay.clear_global_router_replay_action()
    if recorded_logits is not None:
        out["replay_exact"] = torch.equal(recorded_logits, replayed)
        out["forced_changes"] = (forced_logits - recorded_logits).abs().max().item()

    ddp = DistributedDataParallel(
        model.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False),
        model,
    )
    ddp.train()
    ddp.zero_grad_buffer()
    losses = run_schedule(ddp, [input_ids], next_token_loss, forward_only=False)
    finalize_model_grads([ddp])
    out["loss"] = losses[0].item() if losses else None
    out["grads"] = full_tensors(model, grads=True)
    return out


def shard_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, offsets: torch.Tensor, ids: torch.Tensor, upstream: torch.Tensor
) -> dict:
    """Kept-set and full log-probs and entropy on this TP rank's vocabulary shard of ``logits``,
    with the gradient of ``sum(upstream * (masked + full + entropy))`` w.r.t. the shard."""
    from megatron.core import parallel_state

    from moerl.megatron.parallel import init_distributed
    from moerl.trainer.logprobs import entropy, full_logprobs, masked_logprobs

    init_distributed(Layout(tp=int(os.environ["WORLD_SIZE"])))
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    shard = logits.chunk(tp, dim=1)[rank].clone().requires_grad_(True)
    masked, full, ent = masked_logprobs(shard, targets, offsets, ids), full_logprobs(shard, targets), entropy(shard)
    (upstream * (masked + full + ent)).sum().backward()
    return {"masked": masked.detach(), "full": full.detach(), "entropy": ent.detach(), "grad": shard.grad}


def train_steps(mcore_dir: str, trainer_cfg, samples: list, steps: int) -> dict:
    """``steps`` trainer steps on the same batch; metrics per step, the first step's full gradients,
    and the reward-weighted log-likelihood sum_i A_i * sum_t log p(y_it) before and after each step."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    out: dict = {"metrics": [], "objective": []}

    def weighted_loglik() -> float:
        batches = trainer.micro_batches(trainer.batches.scatter(samples))
        trainer.score(batches)
        total = sum(float((mb.advantages * mb.old).sum()) for mb in batches if mb.old is not None)
        total = torch.tensor(total if parallel_state_counts() else 0.0, dtype=torch.float64, device=collective_device())
        torch.distributed.all_reduce(total)
        return total.item()

    out["objective"].append(weighted_loglik())
    for step in range(steps):
        out["metrics"].append(trainer.step(samples))
        if step == 0:
            out["grads"] = full_tensors(trainer.model.module, grads=True)
        out["objective"].append(weighted_loglik())
    return out


def replay_queue_depths(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """The most micro-batches' replay targets any router of this rank queued for a backward replay at once during a
    step, and how many targets it was given in all."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from moerl.trainer.trainer import Trainer

    queue = RouterReplay.set_target_indices
    seen = {"deepest": 0, "given": 0}

    def set_target_indices(router, indices):
        queue(router, indices)
        seen["deepest"], seen["given"] = max(seen["deepest"], len(router.replay_backward_list)), seen["given"] + 1

    RouterReplay.set_target_indices = set_target_indices
    Trainer(mcore_dir, trainer_cfg).step(samples)
    return seen


def scatter_instalment(mcore_dir: str, trainer_cfg, samples: list, window: int | None = None) -> dict:
    """What this rank receives of ``samples`` (given on rank 0) and what it reads; ``window``: rank 0's staging
    window for the sends, if not the default."""
    from moerl.trainer import distribute
    from moerl.trainer.trainer import Trainer

    if window is not None:
        distribute.SCATTER_WINDOW_BYTES = window
    trainer = Trainer(mcore_dir, trainer_cfg)
    instalment = trainer.batches.scatter(samples if torch.distributed.get_rank() == 0 else None)
    return {
        "needs": trainer.batches.needs,
        "samples": instalment.samples,
        "received": instalment.received,
        "advantages": instalment.advantages,
        "staged_peak": trainer.batches.staged_peak,
    }


def refusal(batches, lacking: list) -> str:
    """What ``batches`` (a BatchDistributor) says of an instalment rank 0 must refuse, ``lacking`` (read on rank 0):
    rank 0's error, "told" on every other rank."""
    from moerl.trainer.distribute import BatchFailed

    try:
        batches.scatter(lacking if torch.distributed.get_rank() == 0 else None)
    except ValueError as e:
        return str(e)
    except BatchFailed:
        return "told"
    raise AssertionError("the instalment was not refused")


def parallel_state_counts() -> bool:
    """Whether this rank contributes once to a sum over the batch: the last stage, TP rank 0."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0


def save_and_resume(mcore_dir: str, trainer_cfg, samples: list, save_dir: str, lora=None) -> dict:
    """Two steps straight through, against one step, save, a fresh trainer loading it, one step."""
    from moerl.trainer.trainer import Trainer

    straight = Trainer(mcore_dir, trainer_cfg, lora=lora)
    first = straight.step(samples)
    straight.save(save_dir)
    expected = straight.step(samples)
    expected_weights = full_tensors(straight.model.module)
    resumed = Trainer(mcore_dir, trainer_cfg, lora=lora)
    resumed.load(save_dir)
    got = resumed.step(samples)
    return {
        "first": first,
        "expected": expected,
        "got": got,
        "version": resumed.version,
        "expected_weights": expected_weights,
        "weights": full_tensors(resumed.model.module),
    }


def resume_and_step(mcore_dir: str, trainer_cfg, samples: list, save_dir: str) -> dict:
    """A fresh trainer loading a saved one, then one step."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.load(save_dir)
    return {"got": trainer.step(samples), "weights": full_tensors(trainer.model.module)}


def export_hf(mcore_dir: str, layout: Layout, te_expert_marks: bool = False) -> dict:
    """The Megatron model's tensors under Hub names as the weight sync streams them (on rank 0), what each rank's
    collectives took in, and the global layers each rank holds. ``te_expert_marks``: the routed experts' weights marked
    as TE marks them under expert TP or EP: TEGroupedLinear splits them itself and builds TE's layer with
    parallel_mode=None, which gives every weight partition_dim=0, linear_fc2's (split along dim 1) included."""
    from megatron.core import parallel_state

    from moerl.weight_sync.export import hf_named_tensors

    cfg, model = load_megatron_model(mcore_dir, layout)
    if te_expert_marks:
        marked = [
            p
            for n, p in model.named_parameters()
            if ".local_experts." in n and getattr(p, "tensor_model_parallel", False)
        ]
        assert any(p.partition_dim == 1 for p in marked)  # linear_fc2's, until marked as TE does
        for param in marked:
            param.partition_dim = 0
    gather = Gather(model)
    stream = [(name, tensor.clone()) for name, tensor in hf_named_tensors(gather, cfg)]
    senders = Gather(model, per_sender=True)  # what broadcast sync sends: each sender its own share
    share = [(name, tensor.clone()) for name, tensor in hf_named_tensors(senders, cfg)]
    return {
        "stream": stream,
        "received": gather.received,
        "lead": gather.lead,
        "share": share,
        "share_received": senders.received,
        "sends": senders.sends,
        "layers": sorted(layer.layer_number - 1 for layer in model.decoder.layers),
        "last": parallel_state.is_pipeline_last_stage(),
    }


def train_then_sync(mcore_dir: str, trainer_cfg, samples: list, urls: list[str]) -> dict:
    """One trainer step, then a broadcast sync to the engines at ``urls``; each engine's copy of every
    tensor read back next to the trainer's."""
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.broadcast import BroadcastSync

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.step(samples)
    rank0 = torch.distributed.get_rank() == 0
    sync = BroadcastSync(urls if rank0 else None, "127.0.0.1", "gloo", bucket_bytes=64 << 10)
    sync.connect()
    stats = sync.update(trainer)
    mine = {"sent": sync.sent, "received": sync.gather.received, "group": sync.group_name if sync.sender else None}
    return {**mine, **_served_next_to_trained(sync, trainer, urls, stats)}


def push_deltas(
    mcore_dir: str, trainer_cfg, samples: list, urls: list[str], served_dir: str, quantization: str
) -> dict:
    """Delta pushes (DeltaSync) to engines that start from ``served_dir`` (the trainer's checkpoint, or its FP8 copy):
    two trainer steps, each followed by a push; then, as if the first engine were started again, a third push. Each
    push's stats, and after the last each engine's copy of every tensor read back next to the trainer's."""
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.delta import DeltaSync

    trainer = Trainer(mcore_dir, trainer_cfg)
    rank0 = torch.distributed.get_rank() == 0
    sync = DeltaSync(urls if rank0 else None, served_dir if rank0 else None, bucket_bytes=64 << 10)
    sync.quantization = quantization
    sync.connect()
    sync.start(trainer, engines_hold_it=True)
    pushes = []
    for _ in range(2):
        trainer.step(samples)
        pushes.append(sync.update(trainer))
    if rank0:
        sync.started_again(urls[:1])
    trainer.step(samples)
    pushes.append(sync.update(trainer))
    return {"pushes": pushes, **_served_next_to_trained(sync, trainer, urls, pushes[-1])}


def train_then_hand_over(mcore_dir: str, trainer_cfg, samples: list, urls: list[str]) -> dict:
    """One trainer step, then a colocated push (TensorSync) to the engines at ``urls``, one per rank's GPU: the
    handles each rank made, those rank 0 posted (by GPU, per bucket), and each engine's copy of every tensor read back
    next to the trainer's."""
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync import tensor

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.step(samples)
    rank0 = torch.distributed.get_rank() == 0
    sync = tensor.TensorSync(urls if rank0 else None, bucket_bytes=64 << 10)
    made, posted = [], []
    serialize, post = tensor.serialize, sync.post

    def recorded(payload):
        made.append(serialize(payload))
        return made[-1]

    def recording(handles):
        posted.append(handles)
        post(handles)

    tensor.serialize, sync.post = recorded, recording  # type: ignore[method-assign]
    try:
        stats = sync.update(trainer)
    finally:
        tensor.serialize = serialize
    return {
        "made": made,
        "posted": posted,
        "ranks": sync.handover.ranks,
        **_served_next_to_trained(sync, trainer, urls, stats),
    }


def _served_next_to_trained(sync, trainer, urls: list[str], stats) -> dict:
    """Collective: on rank 0, the trainer's Hub tensors (as the engines hold them: quantized for FP8 ones), each
    engine's copy of them, the engines' versions and the update's ``stats``; nothing elsewhere. Closes ``sync``."""
    from moerl.weight_sync.export import hf_named_tensors
    from tests.engine_server import weights_by_name

    with trainer.on_device():  # a colocated push leaves it off: copies, as the offload after frees what they view
        trained = [
            (name, t.clone())
            for name, t in hf_named_tensors(
                Gather(trainer.model.module), trainer.hf_config, getattr(sync, "quantization", "none")
            )
        ]
    if sync.link is None:
        sync.close()
        return {}
    link = sync.link

    async def read_back():
        return {name: [await weights_by_name(url, name) for url in urls] for name, _ in trained}

    served = link.run(read_back())
    versions = link.run(link.client.weight_versions())
    sync.close()
    return {"stats": stats, "trained": trained, "served": served, "versions": versions}


def sync_with_a_sender_failing_once(mcore_dir: str, trainer_cfg, urls: list[str]) -> dict:
    """A broadcast sync whose rank 1 fails its first turn: the attempt (1 or 2, the push made once more) of each turn
    this
    rank had, and what the engines report after. Then an update once a call has passed over the first engine since
    (as if it went and came back at its address): the groups this rank had formed after each update."""
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.broadcast import BroadcastSync

    trainer = Trainer(mcore_dir, trainer_cfg)
    rank0 = torch.distributed.get_rank() == 0
    sync = BroadcastSync(urls if rank0 else None, "127.0.0.1", "gloo", bucket_bytes=64 << 10)
    sync.connect()
    push_once, send, attempt, turns = sync._push_once, sync._send_buckets, [0], []

    def counted_push(*args):
        attempt[0] += 1
        return push_once(*args)

    def failing_send(named, stats):
        turns.append(attempt[0])
        if not rank0 and attempt[0] == 1:
            raise RuntimeError("a planted failure")
        return send(named, stats)

    sync._push_once, sync._send_buckets = counted_push, failing_send
    sync.update(trainer)
    groups = [sync._groups]
    if rank0:
        sync.may_be_new = {urls[0]}
    sync.update(trainer)
    groups.append(sync._groups)
    versions = sync.link.run(sync.link.client.weight_versions()) if rank0 else None
    sync.close()
    return {"turns": turns, "versions": versions, "version": str(trainer.version), "groups": groups}


def syncs_where_one_engine_refuses_a_bucket_the_other_took(
    mcore_dir: str, trainer_cfg, hf_dir: str, refusing_url: str, log_dir: str
) -> dict:
    """Broadcast updates to two engines: one this rank starts (a pool of one replica, as the job's), one given by URL
    whose
    model's vocabulary differs, so that it refuses the embedding's bucket after the first engine took it. The first
    update (the job restarts what it started) is made again to the restarted engine alone; the second (nothing
    restarted) has no engine left and stops at once. What each update did and what the engines then serve."""
    import time

    from moerl.engines import weight_group
    from moerl.engines.pool import EnginePool, EnginePoolConfig
    from moerl.errors import EnginesDown
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.broadcast import BroadcastSync

    weight_group.TIMEOUT_S = 30  # the refused buckets' broadcasts, which gloo cannot abort, wait this long here
    trainer = Trainer(mcore_dir, trainer_cfg)
    pool = EnginePool(
        EnginePoolConfig(model_path=hf_dir, server="embedded", base_port=0, dtype="float32", log_dir=log_dir)
    )
    pool.start()
    started = pool.replica_urls[0]
    sync = BroadcastSync([started, refusing_url], "127.0.0.1", "gloo", bucket_bytes=64 << 10)
    sync.down_timeout_s = 120
    out: dict = {"started": started, "wedged": [], "announced": []}

    def restart(urls):
        out["wedged"].append(sorted(urls))
        killed = pool.kill(urls)
        sync.may_be_new |= set(pool.revive(max_restarts=3))
        return killed

    try:
        sync.connect()
        announce = sync.sender.client.update_weights_from_distributed

        async def recorded(*args, **kwargs):
            out["announced"].append(list(sync.sender.client.targets))
            return await announce(*args, **kwargs)

        sync.sender.client.update_weights_from_distributed = recorded
        sync.restart_engines, sync.while_down = restart, lambda: sync.may_be_new.update(pool.revive(max_restarts=3))
        out["first"] = sync.update(trainer) is not None
        out["targets"] = list(sync.link.client.targets)
        out["versions"] = sync.link.run(sync.link.client.weight_versions())
        out["restarts"] = dict(pool.restarts)
        out["first_announced"], out["announced"] = out["announced"], []
        # engines given by URL: none restarted
        sync.restart_engines = lambda urls: out["wedged"].append(sorted(urls)) or []
        start = time.monotonic()
        try:
            sync.update(trainer)
        except EnginesDown as e:
            out["second"] = str(e)
        out["second_seconds"] = time.monotonic() - start
    finally:
        sync.close()
        pool.stop()
    return out


def step_whole_and_in_instalments(mcore_dir: str, trainer_cfg, samples: list) -> dict:
    """One step on the whole batch, and one (fresh trainer) on the same batch fed a group at a time: the
    metrics and the gradients each step applied."""
    from moerl.trainer.trainer import Trainer

    whole = Trainer(mcore_dir, trainer_cfg)
    expected = whole.step(samples)
    expected_grads = full_tensors(whole.model.module, grads=True)
    pieced = Trainer(mcore_dir, trainer_cfg)
    groups = sorted({s.group_id for s in samples})
    got = pieced.step(iter([[s for s in samples if s.group_id == g] for g in groups]))
    return {
        "expected": expected,
        "got": got,
        "expected_grads": expected_grads,
        "grads": full_tensors(pieced.model.module, grads=True),
    }


def lora_train_export(
    mcore_dir: str,
    trainer_cfg,
    lora_cfg,
    samples: list,
    input_ids: torch.Tensor,
    steps: int,
    save_dir: str | None = None,
) -> dict:
    """``steps`` LoRA steps on ``samples``; what trains, what changed, the exported adapter and logits."""
    from moerl.megatron.lora_config import is_lora_param
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg, lora=lora_cfg)
    model = trainer.model.module
    before = {n: t.clone() for n, t in (full_tensors(model) or {}).items() if not is_lora_param(n)}
    metrics = [trainer.step(samples) for _ in range(steps)]
    named = dict(model.named_parameters())
    by_id = {id(p): n for n, p in named.items()}
    if save_dir is not None:
        trainer.save(save_dir)
    after = full_tensors(model)
    return {
        "metrics": metrics,
        "lora": Gather(model, select=is_lora_param).gather(),
        "logits": forward_logits(model, input_ids),
        "trainable": sorted(n for n, p in named.items() if p.requires_grad),
        # fp32 on the CPU: megatron's optimizers wrap torch's Adam, whose state is keyed by the parameters themselves
        "with_state": sorted(
            by_id.get(id(p), "?")
            for opt in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
            for p in opt.optimizer.state
        ),
        "base_unchanged": after is None or all(torch.equal(before[n], after[n]) for n in before),
        "lora_names": sorted(n for n in named if is_lora_param(n)),
    }


def te_norm_names(arch: str) -> dict:
    """Where Transformer Engine's layer spec keeps each norm (megatron-core's own spec, built with stand-in
    TE classes since TE needs CUDA), beside the local spec's checkpoint keys and weight export's names."""
    from unittest import mock

    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.mlp import MLPSubmodules

    from moerl.checkpoint.mcore import SHARDED_METADATA
    from moerl.layout import Layout
    from moerl.megatron.model import build_model
    from moerl.megatron.parallel import init_distributed
    from moerl.megatron.weights import global_name
    from moerl.models import family_for
    from moerl.models.tiny import TINY_QWEN2, TINY_QWEN3

    class Norm:  # TENorm: parameter "weight"
        pass

    class LayerNormLinear:  # TELayerNormColumnParallelLinear: its norm's parameter is "layer_norm_weight"
        pass

    class Other:
        pass

    class Backend:
        def __getattr__(self, name):
            return {
                "column_parallel_layer_norm_linear": lambda: LayerNormLinear,
                "layer_norm": lambda **kw: Norm,
                "fuse_layernorm_and_linear": lambda: True,
                "grouped_mlp_modules": lambda *a, **kw: (Other, MLPSubmodules(linear_fc1=Other, linear_fc2=Other)),
            }.get(name, lambda *a, **kw: Other)

    init_distributed(Layout())
    cfg = dict(TINY_QWEN3 if arch.startswith("Qwen3") else TINY_QWEN2, architectures=[arch])
    family = family_for(cfg)
    config = family.transformer_config(family.normalize(cfg), Layout())
    with (
        mock.patch.object(gpt_layer_specs, "TESpecProvider", Backend, create=True),
        mock.patch.object(gpt_layer_specs, "TENorm", Norm, create=True),
    ):
        layers = gpt_layer_specs.get_gpt_decoder_layer_specs(
            config, use_transformer_engine=True, normalization="RMSNorm"
        )
    te_names = set()
    for i, layer in enumerate(layers):
        sub, prefix = layer.submodules, f"decoder.layers.{i}."
        attention = sub.self_attention.submodules
        te_names |= {
            prefix + name
            for name, module in (
                ("input_layernorm.weight", sub.input_layernorm),
                ("self_attention.q_layernorm.weight", attention.q_layernorm),
                ("self_attention.k_layernorm.weight", attention.k_layernorm),
                ("pre_mlp_layernorm.weight", sub.pre_mlp_layernorm),
            )
            if module is Norm
        }
        if attention.linear_qkv is LayerNormLinear:
            te_names.add(prefix + "self_attention.linear_qkv.layer_norm_weight")
        fc1 = getattr(sub.mlp.submodules, "linear_fc1", None)
        if fc1 is LayerNormLinear:
            te_names.add(prefix + "mlp.linear_fc1.layer_norm_weight")
    with torch.device("meta"):
        model = build_model(cfg, Layout())
    local_keys = {
        v.key
        for v in model.sharded_state_dict(metadata=SHARDED_METADATA).values()
        if ("layernorm" in v.key or "layer_norm" in v.key) and not v.key.endswith("_extra_state")
    }
    rule_names = {
        r.mcore
        for r in family.all_rules(family.normalize(cfg))
        if r.mcore.startswith("decoder.layers.") and "norm" in r.mcore
    }
    return {
        "te_names": te_names,
        "local_keys": {k for k in local_keys if k.startswith("decoder.layers.")},
        "exported": {global_name(model, n) for n in te_names},
        "rule_names": rule_names,
        "pattern": family.moe_layer_pattern(family.normalize(cfg)),
    }


def step_at_version(mcore_dir: str, trainer_cfg, samples: list, version: int) -> dict:
    """One trainer step on ``samples`` by a trainer at policy ``version`` (its tokens' lag is version minus theirs)."""
    from moerl.trainer.trainer import Trainer

    trainer = Trainer(mcore_dir, trainer_cfg)
    trainer.version = version
    return trainer.step(samples)


def train_with_routing_one_position_late(mcore_dir: str, trainer_cfg, samples: list, steps: int) -> dict:
    """:func:`train_steps` with a planted fault: every micro-batch's routing rows moved one position later than its
    tokens."""
    import numpy as np

    from moerl.trainer import trainer as trainer_module

    build = trainer_module.build_micro_batch

    def late(*args, **kwargs):
        batch = build(*args, **kwargs)
        if batch.routing is not None:
            batch.routing = np.roll(batch.routing, 1, axis=1)
        return batch

    trainer_module.build_micro_batch = late
    return train_steps(mcore_dir, trainer_cfg, samples, steps)


def train_with_routing_columns_swapped(mcore_dir: str, trainer_cfg, samples: list, steps: int) -> dict:
    """:func:`train_steps` with a planted fault: the routing each rank is sent has its MoE layers in reverse order."""
    from moerl.trainer import distribute

    unpack = distribute._unpack

    def swapped(*args, **kwargs):
        received = unpack(*args, **kwargs)
        for sample in received:
            if sample.routing is not None:
                sample.routing = sample.routing[:, ::-1].copy()
        return received

    distribute._unpack = swapped
    return train_steps(mcore_dir, trainer_cfg, samples, steps)


def train_without_replay(mcore_dir: str, trainer_cfg, samples: list, steps: int) -> dict:
    """:func:`train_steps` with a planted fault: the old-policy pass replays, the training pass (and its recompute)
    never."""
    from moerl.trainer import trainer as trainer_module

    set_action, score = trainer_module.set_action, trainer_module.Trainer.score
    scoring = []

    def score_marked(self, *args, **kwargs):
        scoring.append(True)
        try:
            return score(self, *args, **kwargs)
        finally:
            scoring.pop()

    trainer_module.set_action = lambda action: set_action(action if scoring else None)
    trainer_module.Trainer.score = score_marked
    return train_steps(mcore_dir, trainer_cfg, samples, steps)


def what_each_rank_raises_when_rank_0_fails_an_agreed_step(failure: str) -> tuple[str, str, bool]:
    """A weight sync's step that global rank 0 takes alone fails there (``failure``: ``engines_down`` or ``other``);
    what this rank raises from it: (class name, message, relayed)."""
    from moerl.errors import EnginesDown
    from moerl.megatron.parallel import init_process_group
    from moerl.weight_sync.base import WeightSync, WeightSyncError

    class Agreeing(WeightSync):
        def start(self, trainer, engines_hold_it):
            pass

        def update(self, trainer, only=None):
            pass

        def served(self, version):
            return None, None

    def fails():
        raise (
            EnginesDown("no engine answered")
            if failure == "engines_down"
            else WeightSyncError("an engine does not serve it")
        )

    init_process_group(timeout_s=60)
    rank = torch.distributed.get_rank()
    sync = Agreeing(["http://127.0.0.1:9"] if rank == 0 else None, "agreeing")  # nothing is sent to it
    try:
        sync.agreed(fails)
    except Exception as e:  # noqa: BLE001 - what is raised is the answer
        return type(e).__name__, str(e), getattr(e, "relayed", False)
    finally:
        sync.close()
    return "", "", False


def what_each_rank_raises_from_parts_rank_0_takes_alone(run_dir: str) -> list[tuple[str, object, bool]]:
    """Parts of the job that global rank 0 takes alone, run on every rank: one that succeeds, one that finds the rollout
    manager gone, one that fails otherwise, and a checkpoint whose run state rank 0 cannot write (its buffer holds a
    failed rollout). Per part, what this rank got: ("", result, False) or (class name, message, relayed)."""
    from types import SimpleNamespace

    from moerl.errors import RolloutManagerLost
    from moerl.megatron.parallel import init_process_group, on_lead
    from moerl.orchestrator.rollouts import RolloutError
    from moerl.orchestrator.run_state import save_checkpoint

    def manager_lost():
        raise RolloutManagerLost("the rollout manager process exited (killed by signal 9)")

    def disk_full():
        raise OSError("No space left on device")

    class FailedRollout:
        def drain(self):
            raise RolloutError("rollout of prompt 3 failed: the reward function raised")

    trainer = SimpleNamespace(version=2, save=lambda out: None)  # the trainer's part is collective and saved here
    parts = [
        lambda: on_lead(lambda: "rank 0's", "a part"),
        lambda: on_lead(manager_lost, "a part"),
        lambda: on_lead(disk_full, "recording the step's metrics"),
        lambda: save_checkpoint(trainer, FailedRollout() if torch.distributed.get_rank() == 0 else None, Path(run_dir)),
    ]
    init_process_group(timeout_s=60)
    out = []
    for part in parts:
        try:
            out.append(("", part(), False))
        except Exception as e:  # noqa: BLE001 - what is raised is the answer
            out.append((type(e).__name__, str(e), getattr(e, "relayed", False)))
    return out


def transport_threads_over_initialisations(times: int) -> list[int]:
    """Parallel state initialised ``times`` in this process, a collective run on its tensor-parallel group each time:
    the process's gloo transport threads after each."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from moerl.megatron.parallel import init_distributed

    counts = []
    for _ in range(times):
        init_distributed(Layout())
        one = torch.ones(1)
        dist.all_reduce(one, group=parallel_state.get_tensor_model_parallel_group())
        assert one.item() == dist.get_world_size()
        tasks = Path("/proc/self/task")
        counts.append(sum((t / "comm").read_text().strip() == "gloo_tcp_loop" for t in tasks.iterdir()))
    return counts


def what_a_rank_sees(mark: str) -> tuple[str | None, str]:
    """Says ``mark`` on stdout and stderr; this rank's MOERL_TEST_MARK and working directory."""
    print(f"stdout of rank {os.environ['RANK']}: {mark}", flush=True)
    print(f"stderr of rank {os.environ['RANK']}: {mark}", file=sys.stderr, flush=True)
    return os.environ.get("MOERL_TEST_MARK"), os.getcwd()


def steps_offloaded_between(mcore_dir: str, trainer_cfg, samples: list, steps: int, offload: bool) -> dict:
    """``steps`` trainer steps on the same batch, the trainer's state offloaded after each (``offload``) as a colocated
    run's push leaves it; each step's metrics, the bytes each offload took off the device, what was left on it and how
    many NCCL communicators it suspended (and why none could be, if so), and the final weights."""
    from moerl.trainer.trainer import Trainer, _optimizer_tensors

    trainer = Trainer(mcore_dir, trainer_cfg)
    out: dict = {"metrics": [], "offloaded": [], "left": [], "suspended": []}
    for _ in range(steps):
        out["metrics"].append(trainer.step(samples))
        if offload:
            out["offloaded"].append(trainer.offload())
            held = [*trainer.model.module.parameters(), *_optimizer_tensors(trainer.optimizer)]
            held += [b.grad_data for b in trainer.model.buffers + trainer.model.expert_parallel_buffers]
            out["left"].append(sum(t.untyped_storage().nbytes() for t in held))
            out["suspended"].append(len(trainer.communicators.suspended))
    out["unsupported"] = trainer.communicators.unsupported
    with trainer.on_device():  # copies: the offload after frees what the model's own tensors hold
        out["weights"] = {k: t.clone() for k, t in (full_tensors(trainer.model.module) or {}).items()}
    return out


def tensor_push_failing_after_a_bucket(mcore_dir: str, trainer_cfg, url: str, kill_engine: bool = False) -> dict:
    """A colocated push (TensorSync) whose second bucket fails on rank 0: a planted failure, or its one engine's
    server SIGKILLed (``kill_engine``): what each rank raises (every rank must, none left waiting in a gather), whether
    its trainer kept its weights on the device, and the engines rank 0's sync holds the policy on."""
    import signal
    import time

    import psutil

    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.tensor import TensorSync

    trainer = Trainer(mcore_dir, trainer_cfg)
    rank0 = torch.distributed.get_rank() == 0
    sync = TensorSync([url] if rank0 else None, bucket_bytes=64 << 10)
    sent = [0]
    post = sync.post

    def failing(handles):
        sent[0] += 1
        if sent[0] == 2:
            if not kill_engine:
                raise RuntimeError("a planted failure after one bucket")
            port = int(url.rsplit(":", 1)[1])
            (pid,) = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == "LISTEN"}
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.05)  # the pool that started it reaps it
        post(handles)

    sync.post = failing  # type: ignore[method-assign]
    try:
        sync.update(trainer)
        raised = None
    except Exception as e:  # noqa: BLE001 - reported to the test
        raised = f"{type(e).__name__}: {e}"
    engines = sync.engines if rank0 else None
    sync.close()
    return {"raised": raised, "sent": sent[0], "on_device": not trainer.weights_offloaded, "engines": engines}


def segment_attention_against_references(dtype_name: str) -> dict:
    """Packed rows (a prompt, two responses attending to it, a sample of its own, padding; then the same cut short, at
    another :func:`~moerl.megatron.attention.flex_width`) through
    :class:`~moerl.megatron.attention.SegmentAttention`, queries, keys and values strided views of one fused projection
    as megatron-core's are: on this rank's device, the largest relative gaps of its segment-table path against
    megatron-core's dense-masked path and against each sample's own causal sequence (outputs, and on a GPU the inputs'
    gradients), and of FlexAttention's kernel forward against the dense path on any device."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from moerl.megatron.attention import PackedSegments, SegmentAttention
    from moerl.megatron.parallel import init_distributed
    from moerl.megatron.segments import dense_mask, segment_table

    init_distributed(Layout())
    dtype = getattr(torch, dtype_name)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    heads, groups, dim = 4, 2, 24  # the tiny Qwen3-MoE's: GQA, a head size no power of two
    config = TransformerConfig(
        num_layers=1, hidden_size=64, num_attention_heads=heads, num_query_groups=groups, kv_channels=dim,
        attention_dropout=0.0, params_dtype=dtype, bf16=dtype == torch.bfloat16,
    )  # fmt: skip
    attention = SegmentAttention(config, 1, AttnMaskType.causal, "self").to(device)
    # segments crossing FlexAttention's 128-position blocks: prompt 150, responses 90 and 70 (the prompt's subtree), a
    # sample 110, padding 12; each segment's subtree end
    lengths, exits = [150, 90, 70, 110, 12], [3, 2, 3, 4, 5]
    segments = torch.repeat_interleave(torch.arange(5), torch.tensor(lengths))
    full = segment_table(segments, torch.tensor(exits)[segments]).to(device)
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(full.shape[1], 1, groups, (heads // groups + 2) * dim, generator=gen).to(device, dtype)
    gaps: dict[str, list[float]] = {"flex_vs_dense": [], "kernel_vs_dense": [], "dense_vs_own": [], "grads": []}
    flex_used = True
    for length in (full.shape[1], 200):  # all of it; the prompt and part of the first response
        segments = PackedSegments(full[:, :length].clone())
        mixed = fused[:length].clone().requires_grad_(device.type == "cuda")
        q, k, v = torch.split(mixed, [heads // groups * dim, dim, dim], dim=3)
        q = q.reshape(length, 1, heads, dim)

        def run(mask, packed=None, q=q, k=k, v=v, mixed=mixed):
            out = attention(q, k, v, mask, attn_mask_type=AttnMaskType.causal, packed_seq_params=packed)
            grad = torch.autograd.grad(out.float().square().sum(), mixed)[0] if out.requires_grad else None
            return out.detach().float(), grad

        out, grad = run(None, segments)
        dense, dense_grad = run(dense_mask(segments.table))
        real = min(length, 420)
        # each response as its own sequence after the prompt (the prompt's outputs are its own either way); the sample
        own = dense.clone()
        with torch.no_grad():
            for first, end in ((150, 240), (240, 310), (310, 420)):
                end = min(end, length)
                if first >= end:
                    continue
                rows = torch.tensor(list(range(150 if first < 310 else 0)) + list(range(first, end)), device=device)
                alone = attention(q[rows], k[rows], v[rows], None, attn_mask_type=AttnMaskType.causal).float()
                own[first:end] = alone[-(end - first) :]
            flex_used &= "block_mask" in vars(segments)  # built by the forward, before flex() below
            kernel = attention.flex(q, k, v, segments).float()

        def gap(a, b, real=real):
            return ((a[:real] - b[:real]).abs().max() / b[:real].abs().max()).item()

        gaps["flex_vs_dense"].append(gap(out, dense))
        gaps["kernel_vs_dense"].append(gap(kernel, dense))
        gaps["dense_vs_own"].append(gap(dense, own))
        if grad is not None:
            gaps["grads"].append(gap(grad, dense_grad))
    return {"device": device.type, "flex_used": flex_used, **{name: max(v, default=0.0) for name, v in gaps.items()}}


def verify_fp8_engines(mcore_dir: str, trainer_cfg, samples: list, urls: list[str], strategy: str) -> dict:
    """FP8 engines started from the trainer's checkpoint (its FP8 copy): a trainer step, an FP8 push (``strategy``:
    delta, a whole gather's; broadcast, a per-sender one's; tensor, colocated, whose probe is taken at the push), then
    sync.verify at fp32's tolerance; the trainer's unquantized log-probs of the probe next to the FP8 reference; then a
    second step without a push (tensor: nor a probe taken at one), the engines told its version, and what verify
    raises on each rank."""
    from moerl.trainer.trainer import Trainer
    from moerl.weight_sync.base import probe_ids, probe_logprobs
    from moerl.weight_sync.broadcast import BroadcastSync
    from moerl.weight_sync.tensor import TensorSync

    trainer = Trainer(mcore_dir, trainer_cfg)
    rank0 = torch.distributed.get_rank() == 0
    mine = urls if rank0 else None
    sync = {
        "broadcast": lambda: BroadcastSync(mine, "127.0.0.1", "gloo", bucket_bytes=64 << 10),
        "tensor": lambda: TensorSync(mine, bucket_bytes=64 << 10),
    }[strategy]()
    sync.quantization, sync.verifying = "fp8", True
    sync.connect()
    sync.start(trainer, engines_hold_it=True)
    trainer.step(samples)
    sync.update(trainer)
    ids = probe_ids(trainer.hf_config["vocab_size"])
    worst = sync.verify(trainer, 1e-4)
    reference = sync.trainer_probe(trainer, ids)
    with trainer.weights_on_device():  # a colocated push leaves them off
        plain = probe_logprobs(trainer.model.module, ids)
    trainer.step(samples)  # a policy the engines do not hold, under the version they are told
    if isinstance(sync, TensorSync):
        sync.probe = None
    if sync.link is not None:
        sync.link.run(sync.link.client.set_weight_version(str(trainer.version)))
    stale = None
    try:
        sync.verify(trainer, 1e-4)
    except Exception as e:  # noqa: BLE001 - what each rank raises
        stale = (type(e).__name__, str(e))
    sync.close()
    return {"worst": worst, "reference": reference, "plain": plain, "stale": stale}
