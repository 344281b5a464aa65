"""The GRPO trainer on megatron-core, with Keep Routing and Keep Sampling Mask.

One ``step`` of a global batch of samples: GRPO advantages and aggregation weights over the whole
batch; this data-parallel rank's share, balanced by tokens; micro-batches under a token budget; a
forward-only pass scoring the proximal ("old") policy; a forward-backward pass of the objective; and
an optimizer step. Both passes route as configured (off / R2 / R3) and score over the kept sets when
sampling-mask replay is on, so the actions are scored under the function that sampled them. With on-policy
distillation (``trainer.loss.distill``) the teacher's log-probs the samples carry join the objective
(:func:`~moerl.trainer.objectives.distill_advantages`, :func:`~moerl.trainer.objectives.topk_reverse_kl`). With
process credit (``trainer.loss.credit``) each action takes its own advantage, computed on global rank 0
(:func:`~moerl.trainer.objectives.process_advantages`) and carried to the loss's stage.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Literal, TypedDict

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moerl.checkpoint.mcore import (
    HF_SUBDIR,
    SHARDED_METADATA,
    TRAINER_STATE,
    load_megatron_model,
    load_sharded,
    read_moerl_meta,
    save_sharded,
    write_moerl_meta,
)
from moerl.dtypes import torch_dtype
from moerl.errors import ConfigError
from moerl.layout import Layout
from moerl.megatron.forward import host_to_device, run_schedule
from moerl.megatron.lora import add_lora
from moerl.megatron.lora_config import LoRAConfig
from moerl.megatron.parallel import IdleCommunicators, collective_device, on_lead
from moerl.models import family_for
from moerl.models.qwen_moe import te_usable
from moerl.sample import Sample
from moerl.trainer import objectives, replay_trace
from moerl.trainer.batch import (
    MicroBatch,
    build_micro_batch,
    pack_by_budget,
    shared_units,
    split_by_budget,
    split_into,
    unit_length,
)
from moerl.trainer.config import TrainerConfig
from moerl.trainer.distribute import BatchDistributor, Interlude, LocalInstalment
from moerl.trainer.logprobs import entropy, full_logprobs, logprobs_at, masked_logprobs
from moerl.trainer.offload import StorageOffload
from moerl.trainer.protocol import TrainerLike
from moerl.trainer.routing import (
    LocalRouters,
    ReplayTracer,
    RoutingProbe,
    load_balance,
    replay_through_recompute,
    set_action,
)

LAG_BINS = 5  # version-lag histogram: 0, 1, 2, 3, >= 4
# What megatron's RouterReplay does in a pass: replay the rollout's routing (R3), or under R2 record the old-policy
# pass's routing for the training pass to replay.
ReplayPass = Literal["R3", "R2-record", "R2-replay"]


class _Placement(TypedDict):
    """Where a step's tallies live: the keyword arguments of torch's tensor factories."""

    dtype: torch.dtype
    device: torch.device


class Trainer(TrainerLike):
    def __init__(self, ckpt_dir: str, cfg: TrainerConfig, lora: LoRAConfig | None = None):
        """The model of the Megatron checkpoint ``ckpt_dir``; with ``lora.enabled`` its weights are frozen
        and only per-module (per-expert) adapters train."""
        if cfg.replay.trace_samples and not cfg.replay.trace_dir:
            raise ValueError(
                f"replay.trace_samples={cfg.replay.trace_samples} needs replay.trace_dir: where the replay trace goes"
            )
        self.cfg, self.ckpt_dir = cfg, str(ckpt_dir)
        self.lora = lora if lora is not None and lora.enabled else None
        cuda = torch.cuda.is_available()
        if cfg.optim.moments_dtype != "float32" and not (cfg.optim.distributed_optimizer and cuda and te_usable()):
            raise ConfigError(
                f"trainer.optim.moments_dtype={cfg.optim.moments_dtype} needs megatron-core's precision-aware "
                "optimizer: Transformer Engine's FusedAdam on CUDA, with trainer.optim.distributed_optimizer=true; "
                "set it to float32 here"
            )
        dtype = torch_dtype(cfg.dtype)
        self.layout = Layout(tp=cfg.tp, pp=cfg.pp, ep=cfg.ep)
        # Low-precision router logits flip near-tied experts; megatron-core can compute them in fp32.
        overrides: dict[str, str | int] = {} if dtype == torch.float32 else {"moe_router_dtype": "fp32"}
        if cfg.recompute:
            overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        # LoRA adapts megatron-core's local linear layers; Transformer Engine's fused ones are not supported yet.
        self.hf_config, model = load_megatron_model(
            ckpt_dir,
            self.layout,
            dtype,
            transformer_engine=None if self.lora is None else False,
            ddp_main_grads=True,
            **overrides,
        )
        _experts_own_optimizer(model)
        if self.lora is not None:
            add_lora(model, self.lora)  # before DDP: frozen weights get no gradient buffer and no optimizer state
        config = model.config
        # Losses are sums of globally normalised per-token terms: no averaging over micro-batches or DP ranks.
        config.calculate_per_token_loss = True
        # Micro-batches differ in shape; pipeline stages exchange shapes before activations.
        config.variable_seq_lengths = self.layout.pp > 1
        distributed = cfg.optim.distributed_optimizer and cuda
        self.model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=distributed
            ),
            model,
        )
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=o.lr,
                min_lr=o.min_lr,
                weight_decay=o.weight_decay,
                adam_beta1=o.adam_beta1,
                adam_beta2=o.adam_beta2,
                adam_eps=o.adam_eps,
                clip_grad=o.clip_grad,
                bf16=dtype == torch.bfloat16,
                params_dtype=dtype,
                use_distributed_optimizer=distributed,
                # the hybrid-device optimizer, all of it on the host; megatron-core runs it as a precision-aware one
                optimizer_cpu_offload=o.cpu_offload and distributed,
                optimizer_offload_fraction=1.0 if o.cpu_offload and distributed else 0.0,
                use_precision_aware_optimizer=(o.cpu_offload and distributed) or o.moments_dtype != "float32",
                exp_avg_dtype=torch_dtype(o.moments_dtype),
                exp_avg_sq_dtype=torch_dtype(o.moments_dtype),
            ),
            [self.model],
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if o.lr_warmup_steps else o.lr,
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.lr_warmup_steps,
            lr_decay_steps=o.lr_decay_steps or 1 << 30,
            lr_decay_style=o.lr_decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        family = family_for(self.hf_config)
        self.moe_layers = [i for i, moe in enumerate(family.moe_layer_pattern(self.hf_config)) if moe]
        self.routers = LocalRouters(self.model, self.moe_layers)
        self.batches = BatchDistributor(cfg, self.routers.columns)
        # Packed micro-batches go to Transformer Engine's attention as THD, to the local layers as a segment table.
        self.thd = any(type(m).__name__ == "TEDotProductAttention" for m in model.modules())
        if cfg.shared_prompt and self.thd:
            raise ConfigError(
                "trainer.shared_prompt: Transformer Engine's attention takes packed samples as THD, which cannot "
                "attend to a shared prompt; only megatron-core's local layers (SegmentAttention) run it for now"
            )
        if cfg.recompute:
            replay_through_recompute()
        self.version = 0  # policy version of the current weights
        self.dtype = dtype  # of the weights, as a sync sends them
        # The reference policy of the KL term is the initial model: its trainable weights wait beside the
        # current ones, on their device, so the reference pass swaps them in place (the memory plan counts them).
        self.reference = [p.detach().clone() for p in _trainable(model)] if cfg.loss.kl_coef else None
        if dtype != torch.float32:
            _fp32_output_layer(model)
        self.device = next(model.parameters()).device
        # colocated: what the engines' phase took off the device, the training state (optimizer, gradients) and the
        # weights apart, since the push needs the weights on the device after the training state has left
        self.offloaded_state, self.offloaded_weights = StorageOffload(self.device), StorageOffload(self.device)
        self.communicators = IdleCommunicators() if cfg.suspend_communicators else None

    # ---- colocated placement -------------------------------------------------------------------
    def offload_training_state(self) -> None:
        """After a step: the optimizer's master weights and state to host memory, the gradient buffers freed (each
        step zeroes them). What is already off stays so."""
        self._take_off_training_state()
        self._return_freed_memory()

    def offload(self) -> int:
        """Collective: the device to colocated engines: the training state (:meth:`offload_training_state`), then the
        weights and the KL reference, to host memory, and megatron-core's NCCL communicators suspended
        (:class:`~moerl.megatron.parallel.IdleCommunicators`); the bytes off the device. The next step reloads it all
        once its first instalment arrives."""
        self._take_off_training_state()
        self.offloaded_weights.keep(itertools.chain(self.model.module.parameters(), self.reference or []))
        suspended = self.communicators.suspend() if self.communicators is not None else 0
        self._return_freed_memory()
        return self.offloaded_state.held_bytes + self.offloaded_weights.held_bytes + suspended

    def _take_off_training_state(self) -> None:
        ddp = self.model
        weights = {p.untyped_storage().data_ptr() for p in ddp.module.parameters()}
        state = (t for t in _optimizer_tensors(self.optimizer) if t.untyped_storage().data_ptr() not in weights)
        self.offloaded_state.keep(state)
        self.offloaded_state.free(buffer.grad_data for buffer in ddp.buffers + ddp.expert_parallel_buffers)

    def _return_freed_memory(self) -> None:
        """What an offload freed back to the device: torch's caching allocator keeps freed blocks for this process,
        and the colocated engines that wake next size their KV cache from the memory the device has free."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        """Collective: whatever was offloaded back on the device (the gradient buffers zeroed), the communicators
        first."""
        self.resume_communicators()
        self.offloaded_weights.reload()
        self.offloaded_state.reload()

    def resume_communicators(self) -> None:
        """Collective: megatron-core's communicators back, the rest left where it is (before the process group ends)."""
        if self.communicators is not None:
            self.communicators.resume()

    @property
    def weights_offloaded(self) -> bool:
        return self.offloaded_weights.active

    @contextlib.contextmanager
    def on_device(self):
        """Collective: the trainer's whole state on its device within: reloaded if any was offloaded, and offloaded
        again after, unless what ran within raised: a suspend waits in NCCL for every rank of each communicator, and a
        rank that failed alone would wait there for good (the job stops on an error anyway)."""
        offloaded = self.offloaded_state.active or self.offloaded_weights.active
        self.reload()
        yield
        if offloaded:
            self.offload()

    @contextlib.contextmanager
    def weights_on_device(self):
        """Collective: what a push reads on the device within, the weights (and the KL reference) and the
        communicators, as a step leaves them; the training state stays where it is, since a push while colocated
        engines are awake (a catch-up, the first push of a resumed run) may leave no room for it. Offloaded again
        after if they were off, as :meth:`on_device` does."""
        offloaded = self.offloaded_weights.active
        self.resume_communicators()
        self.offloaded_weights.reload()
        yield
        if offloaded:
            self.offload()

    # ---- batch preparation -------------------------------------------------------------------
    def micro_batches(self, instalment: LocalInstalment) -> list[MicroBatch]:
        """This rank's micro-batches of ``instalment`` (its part of whole GRPO groups, from :attr:`batches`).

        Token weights are each sample's own part of the aggregation (:func:`objectives.sample_weights`);
        :meth:`step` divides by the whole batch's normaliser once every instalment has been seen."""
        # Every rank knows every shard's lengths, so all agree on the micro-batch count without communicating.
        packed = self.cfg.micro_batch_format == "packed"
        group_by = pack_by_budget if packed else split_by_budget
        budget, multiple = self.cfg.micro_batch_tokens, self.layout.tp
        shared = instalment.shard_shared or [[0] * len(lengths) for lengths in instalment.shard_lengths]
        units = [
            shared_units(tokens, lengths, budget)
            for tokens, lengths in zip(shared, instalment.shard_lengths, strict=True)
        ]
        split = [
            group_by([unit_length(u, tokens, lengths) for u in us], budget, multiple=multiple)
            for us, tokens, lengths in zip(units, shared, instalment.shard_lengths, strict=True)
        ]
        count = max(len(g) for g in split)
        # A micro-batch of units, split further where it must, never within a unit (a prompt shared once).
        mine = units[parallel_state.get_data_parallel_rank()]
        groups = [
            [i for u in g for i in mine[u]] for g in split_into(split[parallel_state.get_data_parallel_rank()], count)
        ]
        # what each sample shares with the one before it, where that one is fed before it in its unit
        mine_shared = shared[parallel_state.get_data_parallel_rank()]
        fed_after = {i: mine_shared[i] for members in mine for i in members[1:]}
        samples = instalment.samples
        # only the loss reads kept sets, and a teacher's log-probs
        last = parallel_state.is_pipeline_last_stage()
        use_masks = self.cfg.replay.sampling_mask and last
        distill = self.cfg.loss.distill
        teacher_top_k = distill.top_k if distill.enabled and last else None

        def build(g: list[int], zero: bool = False) -> MicroBatch:
            return build_micro_batch(
                [samples[i] for i in g],
                [0.0 if zero else instalment.advantage(i) for i in g],
                [0.0 if zero else float(instalment.weights[i]) for i in g],
                multiple=self.layout.tp,
                use_masks=use_masks,
                routed_experts=self.routers.num_experts if instalment.routing else None,
                packed=packed,
                shared=[fed_after.get(i, 0) if k else 0 for k, i in enumerate(g)],
                teacher_top_k=teacher_top_k,
            )

        batches = [build(g) for g in groups]
        for mb, g in zip(batches, groups, strict=True):  # a micro-batch per group
            mb.sample_indices = g
        for _ in range(count - len(groups)):  # fewer samples here than micro-batches elsewhere
            dummy = build(groups[0][:1], zero=True)
            dummy.dummy = True
            batches.append(dummy)
        for mb in batches:
            mb.loss_inputs_to(collective_device())
        return batches

    # ---- passes ------------------------------------------------------------------------------
    def _scores(self, logits: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs [T] of the actions under this forward, their logits rows [T, V/tp])."""
        rows = logits[mb.rows, mb.cols].float() / mb.temperature[:, None]
        if self.cfg.replay.sampling_mask:
            # the loss's stage, the only one that scores, receives the kept sets (micro_batches' use_masks)
            assert mb.mask_offsets is not None and mb.mask_ids is not None, "sampling-mask replay without kept sets"
            return masked_logprobs(rows, mb.targets, mb.mask_offsets, mb.mask_ids), rows
        return full_logprobs(rows, mb.targets), rows

    def _extra_inputs(self, mb: MicroBatch, device: torch.device) -> dict:
        return {} if mb.cu_seqlens is None else mb.packed_inputs(device, thd=self.thd)

    def _routing_context(self, mode: ReplayPass | None, training: bool):
        """A context for one forward of a micro-batch: sets its replay targets, or records native routing."""
        recomputed = training and self.cfg.recompute

        @contextlib.contextmanager
        def around(mb: MicroBatch):
            if mode == "R3":
                assert mb.routing is not None, "R3 replays the rollout's routing, which every sample carries"
                RouterReplay.set_replay_data(self.routers.replay_targets(mb.routing, collective_device()))
            elif mode == "R2-replay":
                assert mb.r2_targets is not None, "R2 replays what the old-policy pass recorded"
                RouterReplay.set_replay_data([host_to_device(t, collective_device()) for t in mb.r2_targets])
            yield
            if mode == "R2-record":  # kept in host memory between the passes, as R3's rollout routing is
                mb.r2_targets = [t.to("cpu", copy=True) for t in RouterReplay.get_recorded_data()]
            # Under activation recompute the backward pass replays these targets again (first in, first out), and
            # set_action clears them once the whole pass is done. Otherwise nothing takes them off the backward
            # queue megatron keeps them in: every micro-batch's would stay on the device for the whole pass.
            if not recomputed:
                for router in RouterReplay.global_router_replay_instances:
                    router.replay_backward_list.clear()

        return around

    def score(
        self, batches: list[MicroBatch], into: Literal["old", "ref"] = "old", tracer: ReplayTracer | None = None
    ) -> dict[str, np.ndarray] | None:
        """Forward-only pass with the current weights: fills each micro-batch's ``old`` (or ``ref``)
        log-probs; the ``old`` pass returns per-MoE-layer routing agreement when the batches carry rollout routing
        (else None). Under R2 the ``old`` pass records the routing the training pass then replays. ``tracer``: takes
        the experts used and the native ones."""
        mode: ReplayPass | None = {"off": None, "R2": "R2-record" if into == "old" else None, "R3": "R3"}[
            self.cfg.replay.routing
        ]
        set_action({None: None, "R2-record": RouterReplayAction.RECORD, "R3": RouterReplayAction.REPLAY_FORWARD}[mode])

        def keep(logits, mb):
            setattr(mb, into, self._scores(logits, mb)[0].detach())
            return logits.new_zeros(())

        self.model.eval()
        # The probe costs a gating GEMM and a wait for a copy to the host per router and micro-batch. Only the old
        # pass of rollouts with routing has readers for it: the routing/ and load/ metrics, the mismatch split by
        # routing (routing_differs) and the replay trace (whose tracer exists only for such a pass).
        probe = RoutingProbe(self.routers, batches) if into == "old" and batches[0].routing is not None else None
        try:
            with torch.no_grad(), probe or contextlib.nullcontext():
                run_schedule(
                    self.model,
                    batches,
                    keep,
                    forward_only=True,
                    input_ids_of=lambda mb: mb.input_ids,
                    around_forward=self._routing_context(mode, training=False),
                    extra_inputs=self._extra_inputs,
                )
        finally:
            set_action(None)
        if probe is None:
            return None
        for mb, differs in zip(batches, probe.differing_positions(), strict=True):  # one per micro-batch
            mb.routing_differs = host_to_device(differs, mb.rows.device)[mb.rows, mb.cols]
        if tracer is not None:
            tracer.record("score", probe.used)
            tracer.record("native", probe.native)
        return probe.agreement()

    @contextlib.contextmanager
    def _reference_weights(self):
        """The initial weights in place of the current ones, for the reference pass: each parameter and its
        reference swap places on the device (one parameter of scratch), and swap back after."""
        params, reference = _trainable(self.model.module), self.reference
        assert reference is not None, "a reference pass is asked only of a trainer that keeps the reference"
        _swap(params, reference)
        try:
            yield
        finally:
            _swap(params, reference)

    def step(
        self,
        samples: list[Sample] | Iterable[list[Sample] | Interlude] | None,
        interlude: Callable[[int], None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on a global batch: ``samples``, or an iterable of instalments of it (each whole
        GRPO groups), read on global rank 0 only (pass None elsewhere), which sends each rank its part.
        Each instalment is scored and its gradient accumulated as soon as it arrives, so training overlaps
        generation that is still producing later instalments; the gradient is normalised over the whole batch
        before the update. An :class:`~moerl.trainer.distribute.Interlude` in ``samples`` runs ``interlude(kind)`` on
        every rank between two instalments (the weights are still the last update's)."""
        instalments = [samples] if isinstance(samples, list) else samples
        loss_cfg = self.cfg.loss
        distill = loss_cfg.distill
        mode = self.cfg.replay.routing
        # The step's tallies stay on the device of the logits until _metrics reads them once: a read per micro-batch
        # would make the host wait for each forward before it could launch the backward.
        tally: _Placement = {"dtype": torch.float64, "device": collective_device()}
        sums = torch.zeros(len(_SUMS), **tally)
        maxes = torch.full((len(_MAXES),), float("-inf"), **tally)
        lag_hist = torch.zeros(LAG_BINS, **tally)
        split = torch.zeros(len(MISMATCH_CELLS), len(MISMATCH_STATS), **tally)
        agreement: dict[str, np.ndarray] | None = None
        lengths: list[int] = []  # every sample's action count: what the aggregation normalises by
        count = parallel_state.get_tensor_model_parallel_rank() == 0  # TP ranks compute the same loss: count once

        def loss_fn(logits, mb: MicroBatch):
            new, rows = self._scores(logits, mb)
            old, behaviour, seq, w = mb.old, mb.behaviour, mb.seq, mb.weights
            assert old is not None, "the old-policy pass (score) fills every micro-batch's old log-probs"
            assert mb.teacher is not None or not distill.enabled, "distillation: the plan checked every teacher"
            # the teacher's reverse KL joins the reward's advantage, to be clipped, corrected and aggregated as it is
            adv = objectives.distill_advantages(mb.advantages, old, mb.teacher, distill)
            terms, clipped = objectives.policy_terms(new, old, adv, seq, mb.num_seqs, loss_cfg)
            corr = objectives.correction(old, behaviour, seq, mb.num_seqs, loss_cfg)
            per_token = corr * terms
            # The exact entropy costs a pass over [T, V/tp] and a TP collective: only when it is in the loss.
            ent = entropy(rows) if loss_cfg.entropy_coef else None
            if ent is not None:
                per_token = per_token - loss_cfg.entropy_coef * ent
            kl = (
                objectives.kl_terms(new, mb.ref, loss_cfg.kl_estimator) if mb.ref is not None else torch.zeros_like(new)
            )
            if loss_cfg.kl_coef:
                per_token = per_token + loss_cfg.kl_coef * kl
            topk_kl = _topk_kl(rows, mb)
            if topk_kl is not None:
                per_token = per_token + distill.top_k_coef * topk_kl
            loss = (w * per_token).sum()
            if count and not mb.dummy:
                with torch.no_grad():
                    delta = (old - behaviour).double()
                    k3 = objectives.safe_exp(-delta) + delta - 1
                    ratio = objectives.safe_exp((new - old).double())
                    is_weight = objectives.safe_exp(delta)
                    lag = self.version - mb.versions
                    differs = (
                        mb.routing_differs
                        if mb.routing_differs is not None
                        else torch.zeros_like(lag, dtype=torch.bool)
                    )
                    ones = torch.ones_like(delta)
                    zero = torch.zeros((), **tally)
                    split.index_add_(0, (lag > 0).long() * 2 + differs.long(), torch.stack([ones, delta.abs(), k3], -1))
                    values = {
                        "loss": loss.double(),
                        "tokens": torch.full((), float(mb.num_tokens), **tally),
                        "fed": torch.full((), float(mb.real_positions().sum()), **tally),
                        "prompt_disagree": zero,  # the instalment's, added once on rank 0
                        "clipped": clipped.double().sum(),
                        "is_weight": is_weight.sum(),
                        "is_kept": (corr > 0).double().sum(),
                        "ratio": ratio.sum(),
                        "entropy": ent.double().sum() if ent is not None else zero,
                        "ref_kl": kl.double().sum(),
                        # the k1 estimate of the reverse KL to the teacher, and the teacher's log-prob of the actions
                        "distill_kl": (old - mb.teacher).double().sum() if mb.teacher is not None else zero,
                        "teacher_logprob": mb.teacher.double().sum() if mb.teacher is not None else zero,
                        "topk_kl": topk_kl.double().sum() if topk_kl is not None else zero,
                    }
                    sums.add_(torch.stack([values[name] for name in _SUMS]))
                    torch.maximum(maxes, torch.stack([is_weight.max(), ratio.max(), lag.max().double()]), out=maxes)
                    lag_hist.index_add_(
                        0, lag.clamp(0, LAG_BINS - 1), ones
                    )  # not bincount: on CUDA it reads its input's max
            return loss

        replay = self.cfg.replay
        # Where this step's replay trace goes, None where it traces nothing (__init__ checked that a count has one).
        trace_dir = replay.trace_dir if replay.trace_samples else None
        if trace_dir is not None:
            on_lead(lambda: replay_trace.clear_step(trace_dir, self.version), "clearing the step's replay traces")
        # colocated engines have given the device back by the time a step's data comes
        for number, instalment in enumerate(self.batches.instalments(instalments, interlude, arriving=self.reload)):
            if number == 0:
                self.model.zero_grad_buffer()
                self.optimizer.zero_grad()
            lengths += instalment.action_counts.tolist()
            sums[_SUMS.index("prompt_disagree")] += instalment.prompt_disagreements
            batches = self.micro_batches(instalment)
            tracer = None
            if number == 0 and trace_dir is not None and instalment.routing:
                tracer = ReplayTracer(self.routers, instalment, batches, replay.trace_samples)
                if instalment.originals is not None:
                    replay_trace.write_source(trace_dir, self.version, instalment.originals, replay.trace_samples)
            if self.reference is not None:
                with self._reference_weights():
                    self.score(batches, into="ref")
            agreement = _pool_agreement(agreement, self.score(batches, tracer=tracer))
            self.model.train()
            set_action(None if mode == "off" else RouterReplayAction.REPLAY_FORWARD)
            try:
                with RoutingProbe(self.routers, batches) if tracer else contextlib.nullcontext() as probe:
                    run_schedule(
                        self.model,
                        batches,
                        loss_fn,
                        forward_only=False,
                        input_ids_of=lambda mb: mb.input_ids,
                        around_forward=self._routing_context(
                            {"off": None, "R2": "R2-replay", "R3": "R3"}[mode], training=True
                        ),
                        extra_inputs=self._extra_inputs,
                    )
            finally:
                set_action(None)
            if tracer is not None:
                assert probe is not None, "a traced instalment's training pass runs under a probe"
                self._write_trace(tracer, probe)
        if not lengths:
            raise ValueError("Trainer.step got an empty batch")
        finalize_model_grads([self.model])
        normalizer = objectives.aggregation_normalizer(
            np.array(lengths), loss_cfg.aggregation, loss_cfg.max_response_len
        )
        self.model.scale_gradients(1.0 / normalizer)
        sums[_SUMS.index("loss")] /= normalizer
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.version += 1
        return self._metrics(sums, maxes, lag_hist, split, agreement, grad_norm, ok)

    def _write_trace(self, tracer: ReplayTracer, probe: RoutingProbe) -> None:
        """The replay trace of an instalment, once its training pass (under ``probe``) is done."""
        tracer.record("train", probe.used)
        tracer.record("train_native", probe.native)
        if self.cfg.recompute:
            tracer.record("recompute", probe.recomputed)
        tracer.write(
            self.cfg.replay.trace_dir,
            self.version,
            self.cfg.replay.routing,
            ["score", "train"] + (["recompute"] if self.cfg.recompute else []),
        )

    def _metrics(self, sums, maxes, lag_hist, split, agreement, grad_norm, ok) -> dict[str, float]:
        packed = torch.cat([sums, lag_hist, split.flatten()])
        dist.all_reduce(packed)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        packed, maxes = packed.cpu(), maxes.cpu()
        packed, split = packed[: -split.numel()], packed[-split.numel() :].view(split.shape)
        s = dict(zip(_SUMS, packed[: len(_SUMS)].tolist(), strict=True))
        tokens = max(s["tokens"], 1.0)
        out = {
            "train/loss": s["loss"],
            "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "train/update_skipped": float(not ok),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/clip_fraction": s["clipped"] / tokens,
            "train/ratio_mean": s["ratio"] / tokens,
            "train/ratio_max": maxes[1].item(),
            "train/tokens": s["tokens"],
            "train/tokens_fed": s["fed"],  # the positions each forward computed (a shared prompt counted once)
            # the mismatch over all tokens: the split's cells added up
            "mismatch/abs_logprob_delta": split[:, MISMATCH_STATS.index("abs_delta")].sum().item() / tokens,
            "mismatch/k3_kl": split[:, MISMATCH_STATS.index("k3")].sum().item() / tokens,
            "is/weight_mean": s["is_weight"] / tokens,
            "is/weight_max": maxes[0].item(),
            "is/kept_fraction": s["is_kept"] / tokens,
            "train/ref_kl": s["ref_kl"] / tokens,
            **staleness_metrics(packed[len(_SUMS) :].tolist(), maxes[2].item(), tokens),
        }
        if self.cfg.loss.entropy_coef:
            out["train/entropy"] = s["entropy"] / tokens
        if self.cfg.loss.distill.enabled:
            out["distill/reverse_kl"] = s["distill_kl"] / tokens
            out["distill/teacher_logprob_mean"] = s["teacher_logprob"] / tokens
            if self.cfg.loss.distill.top_k:
                out["distill/topk_kl"] = s["topk_kl"] / tokens
        if self.cfg.shared_prompt:  # fed once, they take the first sample's routing
            out["routing/shared_prompt_disagreements"] = s["prompt_disagree"]
        out.update(mismatch_split_metrics(split.numpy(), routing=agreement is not None))
        if agreement is not None:
            differ = [MISMATCH_CELLS.index("lag0_routing_differ"), MISMATCH_CELLS.index("lagged_routing_differ")]
            out["routing/differs_any_layer"] = split[differ, 0].sum().item() / tokens
            out["routing/agreement"] = float(np.average(agreement["native"], weights=agreement["tokens"]))
            out["routing/replayed"] = float(np.average(agreement["used"], weights=agreement["tokens"]))
            out["routing/max_logit_gap"] = float(agreement["max_logit_gap"])
            for layer, value in zip(self.moe_layers, agreement["native"], strict=True):  # per MoE layer
                out[f"routing/agreement_layer{layer}"] = float(value)
            # Expert load of the engine's routing and of what the trainer's own routers choose: drift between them, and
            # imbalance R3 would carry into training, show here.
            for source in ("rollout", "native"):
                balance, entropy = load_balance(agreement[f"{source}_load"])
                out[f"load/{source}_max_over_mean"], out[f"load/{source}_entropy"] = (
                    float(np.nanmean(balance)),
                    float(np.nanmean(entropy)),
                )
                for layer, b, h in zip(self.moe_layers, balance, entropy, strict=True):
                    out[f"load/{source}_max_over_mean_layer{layer}"], out[f"load/{source}_entropy_layer{layer}"] = (
                        float(b),
                        float(h),
                    )
        return out

    # ---- checkpoints --------------------------------------------------------------------------
    def _sharded_state(self, loading: bool) -> dict:
        model = self.model.module.sharded_state_dict(metadata=SHARDED_METADATA)
        return {
            "model": model,
            "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading, metadata=OPTIMIZER_METADATA),
        }

    def save(self, ckpt_dir: str | Path) -> None:
        """Model, optimizer, LR schedule and policy version in ``dist_checkpointing`` format, loadable at
        any layout. The directory is also a moerl model checkpoint (``tools/convert_ckpt.py``, serving)."""
        ckpt_dir = Path(ckpt_dir)
        on_lead(lambda: ckpt_dir.mkdir(parents=True, exist_ok=False), f"making the checkpoint directory {ckpt_dir}")
        with self.on_device():
            save_sharded(self._sharded_state(loading=False), ckpt_dir)

        def describe() -> None:
            shutil.copytree(Path(self.ckpt_dir) / HF_SUBDIR, ckpt_dir / HF_SUBDIR)
            base = read_moerl_meta(self.ckpt_dir)  # written now in the current format, whatever the base's
            write_moerl_meta(ckpt_dir, base["architecture"], base["dtype"], base.get("hf_source"))
            state = {
                "version": self.version,
                "scheduler": self.scheduler.state_dict(),
                "config": asdict(self.cfg),
                "lora": asdict(self.lora) if self.lora is not None else None,
            }
            (ckpt_dir / TRAINER_STATE).write_text(json.dumps(state, indent=1))

        on_lead(describe, f"writing the trainer state of checkpoint {ckpt_dir}")

    def load(self, ckpt_dir: str | Path) -> None:
        """Restore what :meth:`save` wrote (the model, optimizer, schedule and version)."""
        ckpt_dir = Path(ckpt_dir)
        meta = ckpt_dir / TRAINER_STATE
        if not meta.is_file():
            raise FileNotFoundError(
                f"{ckpt_dir}: no {TRAINER_STATE}; not a trainer checkpoint (Trainer.save writes one)"
            )
        _adam_state_before_loading(self.optimizer)
        _keep_loaded_adam_steps(self.optimizer)
        state = load_sharded(self._sharded_state(loading=True), ckpt_dir)
        self.model.module.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        _own_adam_steps(self.optimizer)
        saved = json.loads(meta.read_text())
        self.scheduler.load_state_dict(saved["scheduler"])
        self.version = saved["version"]


# The distributed optimizer's default format (fully_sharded_model_space) is refused by megatron-core 0.16.1's
# own ShardedTensor check (flattened_range; seen on an H100). fully_reshardable keeps the checkpoint loadable at
# another layout, as the model's is; mem_efficient gathers each DP group's shards into host memory on its first
# rank over gloo instead of all-gathering the whole optimizer state on every rank's GPU.
OPTIMIZER_METADATA = {
    **SHARDED_METADATA,
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": True,
}


def _inner_optimizers(optimizer) -> list:
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    """The tensors megatron-core's optimizer holds: its master weights (or the model's, training in fp32) and its
    state (Adam's moments and step)."""
    for inner in _inner_optimizers(optimizer):
        for group in inner.param_groups:
            yield from group["params"]
        for state in inner.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _adam_state_before_loading(optimizer) -> None:
    """Give a fresh optimizer the state torch's Adam makes at its first step, for the checkpoint to overwrite.

    megatron-core 0.16.1's DistributedOptimizer without Apex or Transformer Engine reads every parameter's Adam
    ``step`` while building the state dict to load into (``state_dict()``: ``assert len(steps) == 1``), which a
    fresh torch Adam has not made: a resumed run with the distributed optimizer failed there on an H100. (With them,
    the step lives in the parameter groups and the fused optimizers keep no per-parameter one.)"""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE

    if HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if opt.init_state_fn is None or inner.state:
            continue
        opt.init_state_fn(inner, opt.config)  # megatron-core's own: the moments, in the configured dtypes
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.tensor(0.0))


def _keep_loaded_adam_steps(optimizer) -> None:
    """Let megatron-core 0.16.1's DistributedOptimizer (without Apex or TE) load a ``fully_reshardable`` checkpoint.

    Its ``load_state_dict`` first gives every parameter's torch Adam state the parameter groups' ``step``, then
    ``load_parameter_state_from_fully_reshardable`` passes each parameter's saved tensors, the step left out, to
    ``_set_main_param_and_optimizer_states``, which copies every key the state holds, ``step`` too: ``KeyError:
    'step'`` (a resumed run on an H200). Each such optimizer's copy is given, for the step, the one just loaded."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(opt, DistributedOptimizer) or opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue  # the precision-aware branch copies only the keys it is given

        def set_states(model_param, tensors, opt=opt, copy=opt._set_main_param_and_optimizer_states):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}
            copy(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states


def _own_adam_steps(optimizer) -> None:
    """Each parameter's Adam ``step`` its own tensor. megatron-core's DistributedOptimizer (without Apex or TE) loads
    one step tensor into every parameter's state, and torch's Adam adds 1 to it in place per parameter: after a resume
    the count would grow by the number of parameters each update, and the bias correction with it."""
    for inner in _inner_optimizers(optimizer):
        for state in inner.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def staleness_metrics(lag_tokens: list[float], max_lag: float, tokens: float) -> dict[str, float]:
    """The step's staleness: its largest version lag, and the fraction of its actions at each lag
    (``lag_tokens``: token counts at lags 0 .. LAG_BINS - 2 and at LAG_BINS - 1 or more)."""
    out = {"staleness/max": max_lag}
    for lag, n in enumerate(lag_tokens):
        out[f"staleness/lag_{lag}{'+' if lag == LAG_BINS - 1 else ''}"] = n / tokens
    return out


def mismatch_split_metrics(split: np.ndarray, routing: bool) -> dict[str, float]:
    """The train-inference mismatch (mean |delta log p| and k3 of the proximal over the behaviour log-probs) over parts
    of the step's tokens. ``split`` [MISMATCH_CELLS, MISMATCH_STATS]: token count and the two sums, per cell of (version
    lag 0 or more) x (the token's position routed natively as the rollout did in every MoE layer, or not). Lag 0 is
    numerics alone; lagged tokens add the policy's drift since they were sampled. ``routing``: the rollout carried
    routing, so the routing split means something. NaN where a part has no tokens."""
    parts = {"lag0": [0, 1], "lagged": [2, 3]}
    if routing:
        parts.update(routing_agree=[0, 2], routing_differ=[1, 3], lag0_routing_agree=[0], lag0_routing_differ=[1])
    out = {}
    for part, cells in parts.items():
        tokens, abs_delta, k3 = split[cells].sum(0)
        out[f"mismatch/abs_logprob_delta_{part}"] = float(abs_delta / tokens) if tokens else float("nan")
        out[f"mismatch/k3_kl_{part}"] = float(k3 / tokens) if tokens else float("nan")
    return out


# Cell of a token in the mismatch split: 2 * (version lag > 0) + (native routing differs from the rollout's somewhere).
MISMATCH_CELLS = ("lag0_routing_agree", "lag0_routing_differ", "lagged_routing_agree", "lagged_routing_differ")
MISMATCH_STATS = ("tokens", "abs_delta", "k3")
_SUMS = (
    "loss",
    "tokens",
    "fed",
    "prompt_disagree",
    "clipped",
    "is_weight",
    "is_kept",
    "ratio",
    "entropy",
    "ref_kl",
    "distill_kl",
    "teacher_logprob",
    "topk_kl",
)
_MAXES = ("is_weight", "ratio", "lag")


def _topk_kl(rows: torch.Tensor, mb: MicroBatch) -> torch.Tensor | None:
    """The reverse KL [T] to the teacher over its top-k ids at each action, where the micro-batch carries them (the
    training pass's temperature-scaled ``rows`` [T, V/tp] give the student's, with gradient); else None."""
    if mb.teacher_top_ids is None or mb.teacher_top_logprobs is None:
        return None
    return objectives.topk_reverse_kl(logprobs_at(rows, mb.teacher_top_ids), mb.teacher_top_logprobs)


def _pool_agreement(total: dict | None, instalment: dict | None) -> dict | None:
    """Routing agreement over two sets of tokens, weighted by their token counts per layer; their expert loads added."""
    if total is None or instalment is None:
        return total or instalment
    tokens = total["tokens"] + instalment["tokens"]
    share = lambda key: (total[key] * total["tokens"] + instalment[key] * instalment["tokens"]) / np.maximum(tokens, 1)
    return {
        "tokens": tokens,
        "native": share("native"),
        "used": share("used"),
        **{key: total[key] + instalment[key] for key in ("rollout_load", "native_load")},
        "max_logit_gap": np.maximum(total["max_logit_gap"], instalment["max_logit_gap"]),
    }


def _experts_own_optimizer(model) -> None:
    """Mark routed-expert weights expert-parallel at every EP size, as megatron-core does only for EP > 1.

    megatron-core gives expert-parallel weights their own optimizer (and gradient buffer, reduced over
    the expert-data-parallel group, which is the data-parallel group when EP = 1). Always splitting
    them out keeps the optimizer's checkpoint structure the same at every layout, so a trainer saved
    at EP 2 resumes at EP 1 and back.
    """
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def _swap(params: list[torch.nn.Parameter], others: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, other in zip(params, others, strict=True):  # others: a copy of each of params
            scratch = p.detach().clone()
            p.copy_(other)
            other.copy_(scratch)


def _fp32_output_layer(model) -> None:
    """Compute the output layer's logits in fp32 from the bf16 hidden states and weight: logits rounded to
    bf16 first (then upcast) carry errors of ~1e-2 in log-probs, as large as the mismatches being corrected."""
    layer = getattr(model, "output_layer", None)
    if layer is None:  # not the last pipeline stage
        return
    # The weight reaches the GEMM as an fp32 copy, which has no main_grad for a fused accumulation to add into.
    layer.gradient_accumulation_fusion = False
    plain = layer.forward

    def forward(input_, weight=None, **kwargs):
        weight = layer.weight if weight is None else weight  # a tied embedding is passed in by GPTModel
        return plain(input_.float(), weight=weight.float(), **kwargs)

    layer.forward = forward


def _trainable(model) -> list[torch.nn.Parameter]:
    return [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
