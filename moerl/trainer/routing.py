"""Keep Routing: rollout routing as megatron-core RouterReplay targets, and routing agreement.

A router sees its tokens as ``[s_local, b]`` flattened sequence-major, where ``s_local`` is this TP
rank's chunk of the sequence under sequence parallelism. This rank's routers are those of its
pipeline stage, in build order, which is the order ``RouterReplay.set_replay_data`` expects.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moerl.megatron.parallel import collective_device

ROUTING_MODES = ("off", "R2", "R3")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


class LocalRouters:
    """This rank's routers, each with its column in the rollout routing (which lists MoE layers only); the trainer
    receives only these columns, in this order."""

    def __init__(self, model, moe_layers: list[int]):
        self.moe_layers = moe_layers
        self.routers, self.columns = [], []
        for layer in _unwrap(model).decoder.layers:
            router = getattr(layer.mlp, "router", None)
            if router is not None:
                self.routers.append(router)
                self.columns.append(moe_layers.index(layer.layer_number - 1))
        replay = RouterReplay.global_router_replay_instances
        if len(replay) != len(self.routers):
            raise RuntimeError(f"{len(replay)} RouterReplay instances for {len(self.routers)} routers: build the model with "
                               "moe_enable_routing_replay and one model per process (moerl.megatron.model.build_model)")
        self.num_experts = _unwrap(model).config.num_moe_experts
        sp = parallel_state.get_tensor_model_parallel_world_size()
        self.sp_size, self.sp_rank = (sp, parallel_state.get_tensor_model_parallel_rank()) if sp > 1 else (1, 0)

    def token_order(self, array: np.ndarray) -> np.ndarray:
        """``[b, s, ...]`` -> this rank's router order ``[s_local * b, ...]``."""
        b, s = array.shape[:2]
        chunk = s // self.sp_size
        local = np.swapaxes(array, 0, 1)[self.sp_rank * chunk : (self.sp_rank + 1) * chunk]
        return local.reshape(chunk * b, *array.shape[2:])

    def replay_targets(self, routing: np.ndarray) -> list[torch.Tensor]:
        """One int64 ``[s_local * b, topk]`` tensor per local router from ``[b, s, local routers, topk]`` (the
        rollout routing of this rank's MoE layers only, as :mod:`moerl.trainer.distribute` delivers it)."""
        ordered = self.token_order(routing)
        return [torch.from_numpy(ordered[:, i].astype(np.int64)) for i in range(len(self.routers))]


def replay_through_recompute() -> None:
    """Make every router's REPLAY_FORWARD also right under activation recompute.

    A recomputed forward runs inside the backward pass, after later micro-batches have set their
    own targets; there the router must take its micro-batch's targets in first-in-first-out order,
    which is megatron-core's REPLAY_BACKWARD (fed by every ``set_replay_data``). megatron-core never
    switches to it by itself, so each replay instance switches while autograd is running a backward.
    """
    for instance in RouterReplay.global_router_replay_instances:
        if getattr(instance, "_moerl_recompute_aware", False):
            continue
        plain = instance.get_replay_topk

        def get_replay_topk(*args, _instance=instance, _plain=plain, **kwargs):
            if _instance.router_replay_action == RouterReplayAction.REPLAY_FORWARD and torch._C._current_graph_task_id() != -1:
                _instance.router_replay_action = RouterReplayAction.REPLAY_BACKWARD
                try:
                    return _plain(*args, **kwargs)
                finally:
                    _instance.router_replay_action = RouterReplayAction.REPLAY_FORWARD
            return _plain(*args, **kwargs)

        instance.get_replay_topk = get_replay_topk
        instance._moerl_recompute_aware = True


def set_action(action: RouterReplayAction | None) -> None:
    RouterReplay.clear_global_indices()
    if action is None:
        RouterReplay.clear_global_router_replay_action()
    else:
        RouterReplay.set_global_router_replay_action(action)


class RoutingProbe:
    """Forward hooks on this rank's routers recording, for every token, the trainer's native top-k
    (from the router's own logits) and the expert set actually used (its routing map), to compare
    with the rollout's routing."""

    def __init__(self, routers: LocalRouters):
        self.routers = routers
        self.native: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.used: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self._handles = []

    def __enter__(self) -> "RoutingProbe":
        for i, router in enumerate(self.routers.routers):
            self._handles.append(router.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, i: int):
        def hook(router, inputs, outputs):
            with torch.no_grad():
                logits = router.gating(inputs[0]).float()
                logits = logits.reshape(-1, logits.shape[-1])  # [s, b, E] -> [s * b, E], sequence-major
                self.native[i].append(logits.topk(router.topk, dim=-1).indices.sort(dim=-1).values.cpu())
                _, routing_map = outputs
                self.used[i].append(routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).sort(dim=-1).values.cpu())

        return hook

    def agreement(self, batches: list) -> dict[str, np.ndarray]:
        """Per MoE layer (global, over all ranks): tokens counted, tokens whose native top-k set equals
        the rollout's, tokens whose used set equals the rollout's; and per layer and expert, the tokens the rollout
        and the trainer's native routing send there (``rollout_load``, ``native_load`` [layers, experts]). ``batches``
        are the micro-batches in the order they ran, each with ``routing`` [b, s, local routers, k] and
        :meth:`real_positions`."""
        layers, experts = len(self.routers.moe_layers), self.routers.num_experts
        counts = torch.zeros(3, layers, dtype=torch.float64)
        loads = torch.zeros(2, layers, experts, dtype=torch.float64)
        for m, batch in enumerate(batches):
            if batch.dummy:
                continue
            real = torch.from_numpy(self.routers.token_order(batch.real_positions()))
            rollout = self.routers.token_order(batch.routing)
            for i, column in enumerate(self.routers.columns):
                target = torch.from_numpy(np.sort(rollout[:, i].astype(np.int64), axis=-1))
                counts[0, column] += real.sum()
                counts[1, column] += ((self.native[i][m] == target).all(-1) & real).sum()
                counts[2, column] += ((self.used[i][m] == target).all(-1) & real).sum()
                loads[0, column] += torch.bincount(target[real].flatten(), minlength=experts).double()
                loads[1, column] += torch.bincount(self.native[i][m][real].flatten(), minlength=experts).double()
        if dist.is_initialized():
            both = torch.cat([counts.flatten(), loads.flatten()]).to(collective_device())  # NCCL refuses CPU tensors
            dist.all_reduce(both)
            counts, loads = both.cpu().split([counts.numel(), loads.numel()])
            counts, loads = counts.view(3, layers), loads.view(2, layers, experts)
        tokens = counts[0].clamp(min=1)
        return {"tokens": counts[0].numpy(), "native": (counts[1] / tokens).numpy(), "used": (counts[2] / tokens).numpy(),
                "rollout_load": loads[0].numpy(), "native_load": loads[1].numpy()}


def load_balance(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, from ``load`` [layers, experts] (tokens sent to each expert): the busiest expert's load over the mean
    (1 when even; experts / topk when every token goes to the same experts) and the entropy of the load over
    log(experts) (1 when even). NaN for a layer with no tokens."""
    total = load.sum(-1)
    share = load / np.where(total > 0, total, np.nan)[:, None]
    balance = load.max(-1) / np.where(total > 0, load.mean(-1), np.nan)
    entropy = -np.where(share > 0, share * np.log(np.where(share > 0, share, 1.0)), 0.0).sum(-1) / np.log(load.shape[-1])
    return balance, np.where(total > 0, entropy, np.nan)
