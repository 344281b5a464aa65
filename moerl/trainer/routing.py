"""Keep Routing: rollout routing as megatron-core RouterReplay targets, and routing agreement.

A router sees its tokens as ``[s_local, b]`` flattened sequence-major, where ``s_local`` is this TP
rank's chunk of the sequence under sequence parallelism. This rank's routers are those of its
pipeline stage, in build order, which is the order ``RouterReplay.set_replay_data`` expects.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moerl.megatron.forward import host_to_device
from moerl.megatron.parallel import collective_device
from moerl.trainer.replay_trace import TracedSample, write_rank

log = logging.getLogger(__name__)


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
            raise RuntimeError(
                f"{len(replay)} RouterReplay instances for {len(self.routers)} routers: build the model with "
                "moe_enable_routing_replay and one model per process (moerl.megatron.model.build_model)"
            )
        self.num_experts = _unwrap(model).config.num_moe_experts
        sp = parallel_state.get_tensor_model_parallel_world_size()
        self.sp_size: int = sp if sp > 1 else 1
        self.sp_rank: int = parallel_state.get_tensor_model_parallel_rank() if sp > 1 else 0

    def chunk(self, s: int) -> slice:
        """The positions of a length-``s`` row that this rank's routers see."""
        size = s // self.sp_size
        return slice(self.sp_rank * size, (self.sp_rank + 1) * size)

    def token_order(self, array: np.ndarray) -> np.ndarray:
        """``[b, s, ...]`` -> this rank's router order ``[s_local * b, ...]``."""
        b, s = array.shape[:2]
        local = np.swapaxes(array, 0, 1)[self.chunk(s)]
        return local.reshape(local.shape[0] * b, *array.shape[2:])

    @staticmethod
    def batch_order(tokens: torch.Tensor, b: int) -> torch.Tensor:
        """This rank's router order ``[s_local * b, ...]`` -> ``[b, s_local, ...]`` (the inverse of :meth:`token_order`
        over this rank's chunk)."""
        return tokens.view(-1, b, *tokens.shape[1:]).transpose(0, 1)

    def replay_targets(self, routing: np.ndarray, device: torch.device) -> list[torch.Tensor]:
        """One int64 ``[s_local * b, topk]`` tensor per local router, on ``device``, from ``[b, s, local routers,
        topk]`` (the rollout routing of this rank's MoE layers only, as :mod:`moerl.trainer.distribute` delivers
        it). All routers' go in one copy that does not hold the host, in the rollout's dtype (uint8: an eighth of
        int64's bytes), and are widened on the device."""
        ordered = host_to_device(torch.from_numpy(np.ascontiguousarray(self.token_order(routing))), device)
        return [ordered[:, i].long() for i in range(len(self.routers))]


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
            if (
                _instance.router_replay_action == RouterReplayAction.REPLAY_FORWARD
                and torch._C._current_graph_task_id() != -1
            ):
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
    with the rollout's routing. A forward that autograd runs inside the backward pass (activation recompute) records
    its used sets apart, in ``recomputed``."""

    def __init__(self, routers: LocalRouters, batches: list):
        self.routers, self.batches = routers, batches
        self.native: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.used: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.recomputed: list[list[torch.Tensor]] = [[] for _ in routers.routers]
        self.gaps: list[torch.Tensor] = []  # per router and micro-batch run, on the device: see :meth:`_gap`
        self._rollout: tuple[int, torch.Tensor, torch.Tensor] | None = None  # micro-batch, its routing, real positions
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> RoutingProbe:
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
                _, routing_map = outputs
                used = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1).sort(dim=-1).values.cpu()
                if torch._C._current_graph_task_id() != -1:
                    self.recomputed[i].append(used)
                    return
                m = len(self.used[i])
                self.used[i].append(used)
                logits = router.gating(inputs[0]).float()
                logits = logits.reshape(-1, logits.shape[-1])  # [s, b, E] -> [s * b, E], sequence-major
                top = logits.topk(router.topk, dim=-1)
                self.native[i].append(top.indices.sort(dim=-1).values.cpu())
                if not self.batches[m].dummy:
                    self.gaps.append(self._gap(m, i, logits, top.values[:, -1]))

        return hook

    def _gap(self, m: int, i: int, logits: torch.Tensor, kth: torch.Tensor) -> torch.Tensor:
        """The most, over micro-batch ``m``'s real tokens, that the lowest of the rollout's experts at local router
        ``i`` falls below the trainer's own k-th choice, in router logits: 0 where the sets agree; the size of
        rounding where they differ only at a tie, as two engines' kernels can break it apart."""
        if self._rollout is None or self._rollout[0] != m:
            batch = self.batches[m]
            routing = torch.from_numpy(np.ascontiguousarray(self.routers.token_order(batch.routing)))
            real = torch.from_numpy(np.ascontiguousarray(self.routers.token_order(batch.real_positions())))
            self._rollout = (m, host_to_device(routing, logits.device), host_to_device(real, logits.device))
        _, routing, real = self._rollout
        lowest = logits.gather(1, routing[:, i].long()).min(dim=-1).values
        return torch.where(real, kth - lowest, 0.0).max()

    def _layers(self, m: int, batch):
        """Per local router of micro-batch ``m``: its column in the rollout routing, the rollout's experts sorted
        ``[s_local * b, k]``, and whether the trainer's native top-k set equals them ``[s_local * b]``."""
        rollout = self.routers.token_order(batch.routing)
        for i, column in enumerate(self.routers.columns):
            target = torch.from_numpy(np.sort(rollout[:, i].astype(np.int64), axis=-1))
            yield i, column, target, (self.native[i][m] == target).all(-1)

    def agreement(self) -> dict[str, np.ndarray]:
        """Per MoE layer (global, over all ranks): tokens counted, tokens whose native top-k set equals
        the rollout's, tokens whose used set equals the rollout's; and per layer and expert, the tokens the rollout
        and the trainer's native routing send there (``rollout_load``, ``native_load`` [layers, experts]); and the
        largest of :meth:`_gap` over all (``max_logit_gap``)."""
        layers, experts = len(self.routers.moe_layers), self.routers.num_experts
        counts = torch.zeros(3, layers, dtype=torch.float64)
        loads = torch.zeros(2, layers, experts, dtype=torch.float64)
        for m, batch in enumerate(self.batches):
            if batch.dummy:
                continue
            real = torch.from_numpy(np.ascontiguousarray(self.routers.token_order(batch.real_positions())))
            for i, column, target, native_same in self._layers(m, batch):
                counts[0, column] += real.sum()
                counts[1, column] += (native_same & real).sum()
                counts[2, column] += ((self.used[i][m] == target).all(-1) & real).sum()
                loads[0, column] += torch.bincount(target[real].flatten(), minlength=experts).double()
                loads[1, column] += torch.bincount(self.native[i][m][real].flatten(), minlength=experts).double()
        gap = (torch.stack(self.gaps).max() if self.gaps else torch.zeros(())).to(collective_device())
        if dist.is_initialized():
            both = torch.cat([counts.flatten(), loads.flatten()]).to(collective_device())  # NCCL refuses CPU tensors
            dist.all_reduce(both)
            dist.all_reduce(gap, op=dist.ReduceOp.MAX)
            counts, loads = both.cpu().split([counts.numel(), loads.numel()])
            counts, loads = counts.view(3, layers), loads.view(2, layers, experts)
        tokens = counts[0].clamp(min=1)
        return {
            "tokens": counts[0].numpy(),
            "native": (counts[1] / tokens).numpy(),
            "used": (counts[2] / tokens).numpy(),
            "rollout_load": loads[0].numpy(),
            "native_load": loads[1].numpy(),
            "max_logit_gap": gap.cpu().numpy(),
        }

    def differing_positions(self) -> list[torch.Tensor]:
        """Per micro-batch, bool ``[b, s]``: the positions whose trainer-native experts differ from the rollout's in at
        least one MoE layer of the whole model. This rank sees its pipeline stage's layers and, under sequence
        parallelism, its chunk of the sequence; the model-parallel group (the ranks that ran the same micro-batches)
        joins them in one collective of one byte per position."""
        sizes = [batch.input_ids.numel() for batch in self.batches]
        differs = torch.zeros(sum(sizes), dtype=torch.uint8)
        for m, (batch, flat) in enumerate(zip(self.batches, differs.split(sizes), strict=True)):
            if batch.dummy or not self.routers.routers:
                continue
            b, s = batch.input_ids.shape
            local = torch.zeros(b * s // self.routers.sp_size, dtype=torch.bool)
            for _, _, _, native_same in self._layers(m, batch):
                local |= ~native_same
            flat.view(b, s)[:, self.routers.chunk(s)] = self.routers.batch_order(local, b).to(torch.uint8)
        group = parallel_state.get_model_parallel_group() if dist.is_initialized() else None
        if group is not None and dist.get_world_size(group) > 1:
            joined = differs.to(collective_device())
            dist.all_reduce(joined, op=dist.ReduceOp.MAX, group=group)
            differs = joined.cpu()
        return [
            flat.view(batch.input_ids.shape).bool()
            for batch, flat in zip(self.batches, differs.split(sizes), strict=True)
        ]


class ReplayTracer:
    """This rank's part of the replay trace (:mod:`moerl.trainer.replay_trace`) of the first ``count`` samples of its
    shard of an instalment: what its routers used in each pass at the positions of its sequence chunk, beside the
    rollout's experts as it received them and, on the first pipeline stage, the tokens it fed."""

    def __init__(self, routers: LocalRouters, instalment, batches: list, count: int):
        self.routers, self.batches = routers, batches
        self.where: list[tuple[int, int, int]] = []  # per traced sample: micro-batch, row, column of its position 0
        self.samples: list[TracedSample] = []
        dp, first_stage = parallel_state.get_data_parallel_rank(), parallel_state.is_pipeline_first_stage()
        located = {i: (m, j) for m, mb in enumerate(batches) if not mb.dummy for j, i in enumerate(mb.sample_indices)}
        # the shard's first samples, wherever the micro-batches put them
        for i in range(min(count, len(instalment.samples))):
            m, j = located[i]
            mb, sample = batches[m], instalment.samples[i]
            row, col = (0, int(mb.cu_seqlens[j])) if mb.cu_seqlens is not None else (j, 0)
            seen = routers.chunk(mb.input_ids.shape[1])
            start = min(max(0, seen.start - col), sample.fed_len)
            stop = max(start, min(sample.fed_len, seen.stop - col))
            self.where.append((m, row, col))
            arrays = {"rollout": sample.routing[start:stop]}
            if first_stage:  # the stage that feeds the tokens to the model
                arrays["tokens_fed"] = mb.input_ids[row, col + start : col + stop].numpy().astype(np.int64)
            self.samples.append(TracedSample(f"dp{dp}-i{i}", sample.fed_len, start, stop, arrays))

    def record(self, name: str, sets: list[list[torch.Tensor]]) -> None:
        """``sets``: per local router, per micro-batch in the order they ran, ``[s_local * b, k]`` (a probe's). A pass
        whose forwards do not match the micro-batches one to one is left out, which the check reports."""
        if any(len(per_router) != len(self.batches) for per_router in sets):
            log.warning(
                "replay trace: %s recorded %s forwards for %d micro-batches; left out of the trace",
                name,
                sorted({len(r) for r in sets}),
                len(self.batches),
            )
            return
        dtype = np.uint8 if self.routers.num_experts <= 256 else np.int16
        for sample, (m, row, col) in zip(self.samples, self.where, strict=True):  # appended together
            b, s = self.batches[m].input_ids.shape
            # the sample's first recorded position, in this chunk
            first = col + sample.start - self.routers.chunk(s).start
            per_router = [
                self.routers.batch_order(per_mb[m], b)[row, first : first + sample.stop - sample.start]
                for per_mb in sets
            ]
            k = sample.arrays["rollout"].shape[-1]
            stacked = torch.stack(per_router, 1).numpy() if per_router else np.zeros((sample.stop - sample.start, 0, k))
            sample.arrays[name] = stacked.astype(dtype)

    def write(self, directory, version: int, mode: str, passes: list[str]) -> None:
        """``passes``: those this step ran; one the tracer had to leave out is missing from the file, and the check says
        so."""
        write_rank(
            directory,
            version,
            dist.get_rank(),
            mode,
            self.routers.moe_layers,
            self.routers.columns,
            passes,
            self.samples,
        )


def load_balance(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, from ``load`` [layers, experts] (tokens sent to each expert): the busiest expert's load over the mean
    (1 when even; experts / topk when every token goes to the same experts) and the entropy of the load over
    log(experts) (1 when even). NaN for a layer with no tokens."""
    total = load.sum(-1)
    share = load / np.where(total > 0, total, np.nan)[:, None]
    balance = load.max(-1) / np.where(total > 0, load.mean(-1), np.nan)
    entropy = -np.where(share > 0, share * np.log(np.where(share > 0, share, 1.0)), 0.0).sum(-1) / np.log(
        load.shape[-1]
    )
    return balance, np.where(total > 0, entropy, np.nan)
