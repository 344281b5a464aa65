"""The memory plan: what each trainer rank and each engine GPU will hold, from the model's config.json
alone, checked before anything is launched.

Per trainer rank (the worst pipeline stage): the model's weights in the training dtype, fp32 gradient
buffers, Adam's state (an fp32 master copy when training in bf16, and two moments), divided over data
parallelism by the distributed optimizer, the KL reference's copy of the weights, and the loss's inputs for a
whole step at most (kept sets included). Then what the largest micro-batch the config allows holds: a sample
longer than ``micro_batch_tokens`` is a micro-batch of its own, so that is ``max(micro_batch_tokens, prompt +
max_new_tokens)`` tokens: an estimate of its activations, the fp32 logits' copies, and, where megatron-core's
local attention computes a padded micro-batch (no Transformer Engine), the ``s x s`` attention scores. Per engine
GPU: the weights and the KV cache left within SGLang's ``mem_fraction_static``, and outside it the communicators of a
broadcast weight sync. The plan is for GPUs of ``run.device_memory_gb`` (default: the visible GPU's memory,
else 80 GB), with ``auto`` dtypes meaning bf16 as they do on a GPU, so it can be made anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moerl import fp8
from moerl.engines.weight_group import MAX_GROUPS_PER_ENGINE
from moerl.errors import ConfigError
from moerl.models.family import ModelFamily, TensorRule
from moerl.orchestrator.config import started_scorers
from moerl.orchestrator.placement import (
    COMMUNICATOR_BYTES,
    TRAINER_RESIDENT_BYTES,
    Colocation,
    Placement,
    ScorerMemory,
    placement_of,
)

if TYPE_CHECKING:
    from moerl.layout import Layout
    from moerl.orchestrator.config import RunConfig
    from moerl.trainer.config import TrainerConfig

GIB = 1 << 30
USABLE = 0.9  # of a trainer GPU: the CUDA context, NCCL buffers and fragmentation take the rest
# Per response token, the loss's inputs that a rank holds on its device for a whole instalment
# (MicroBatch.loss_inputs_to; a sync step is one instalment): rows, cols, targets, seq, versions and the kept sets'
# offsets in int64; temperature, weights, advantages, the engine's, the proximal and the reference log-probs in float32;
# routing_differs. Each kept id adds 4 bytes (int32).
LOSS_BYTES_PER_TOKEN = 6 * 8 + 6 * 4 + 1
KEPT_ID_BYTES = 4
# A prompt's length, which no key bounds (an engine takes any up to the model's context less max_new_tokens): the
# longest sample is taken as this plus max_new_tokens, within the context. The GSM8K recipe's prompts, chat template
# and system prompt included, are a few hundred tokens at most.
PROMPT_TOKENS = 2048
# Per element of one layer's [b, heads/tp, s, s] scores in megatron-core's local attention (DotProductAttention and
# FusedScaleMaskSoftmax's torch path), by training dtype, as measured on the CPU
# (tests/orchestrator/test_memory_plan.py): the preallocated "mpu" buffer, which persists (baddbmm allocates its own
# output beside it); what each layer keeps for the backward (the fp32 softmax output, and in bf16 its bf16 cast); and
# one layer's transients (bf16: the scores and their fp32 copy; fp32: the backward's three gradients).
SCORE_BYTES = {2: {"buffer": 2, "kept": 6, "transient": 6}, 4: {"buffer": 4, "kept": 4, "transient": 12}}
# The [s, s] causal mask megatron-core builds per layer on a GPU when none is given (padded micro-batches): fp32 ones
# and their triu (8 bytes an element, transient), cast to a bool mask that the layer keeps for its backward.
CAUSAL_MASK_TRANSIENT_BYTES = 8
TP_SPLIT = (".linear_qkv.", ".linear_proj.", ".linear_fc1.", ".linear_fc2.", "word_embeddings.", "output_layer.")


@dataclass
class RankMemory:
    params: int  # model parameters this rank holds
    trainable: int  # of which trained (all, or the LoRA adapters)
    terms: dict[str, float] = field(default_factory=dict)  # bytes by what holds them

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass
class MicroBatchShape:
    """The largest micro-batch the config allows: ``tokens`` in all (padding included), in rows of up to ``width``."""

    tokens: int
    width: int
    longest: int  # the longest sample (longest_sample), within the model's context
    bound: str  # the config key that bounds it
    logits_copies: int
    attention: str  # the kernel the trainer's attention runs on a GPU: one of ATTENTION


@dataclass
class MemoryPlan:
    device_bytes: float
    trainer: RankMemory
    engine_weights: float  # bytes per engine GPU
    engine_kv_tokens: int  # tokens of KV cache each replica holds
    problems: list[str]
    micro_batch: MicroBatchShape
    senders: int = 0  # trainer ranks that each form a weight-sync group with every engine (broadcast sync)
    communicators: float = 0.0  # bytes of those groups' communicators per engine GPU, as many as it may hold
    colocated: Colocation | None = None
    host: dict[str, float] = field(default_factory=dict)  # bytes a trainer rank keeps in host memory, by what
    scorers: list[ScorerMemory] = field(default_factory=list)  # the scorers whose replicas the job starts
    scorer_gpus: int = 0  # the GPUs those take, beside the trainer's and the policy engines'

    def table(self) -> str:
        mb = self.micro_batch
        attention = ATTENTION[mb.attention]
        lines = [
            f"memory plan (device {self.device_bytes / GIB:.0f} GiB; trainer ranks use up to {USABLE:.0%}):",
            f"  trainer rank: {self.trainer.params:,} parameters ({self.trainer.trainable:,} trained)",
            f"  largest micro-batch: {mb.tokens:,} tokens in rows of up to {mb.width:,}; longest sample "
            f"{mb.longest:,} tokens ({_bound_text(mb.bound)}, within the model's context)",
            f"  {mb.logits_copies} fp32 logits copies; attention: {attention}",
        ]
        lines += [f"    {name:<30}{_size(value):>12}" for name, value in self.trainer.terms.items()]
        lines.append(f"    {'total':<30}{_size(self.trainer.total):>12}")
        lines.append(
            f"  engine GPU: weights {_size(self.engine_weights)}, KV cache for {self.engine_kv_tokens:,} "
            "tokens per replica"
        )
        if self.senders:
            lines.append(
                f"    weight-sync communicators {_size(self.communicators)}, outside mem_fraction_static: "
                f"{self.senders} sender(s) x {MAX_GROUPS_PER_ENGINE} groups x {COMMUNICATOR_BYTES >> 20} MiB"
            )
        for s in self.scorers:
            where = (
                f"{s.scorer.gpus} GPU(s) of their own, beside the trainer's and the engines'"
                if self.colocated is None
                else "on the trainer's GPUs, released while it trains (its weights kept in host memory)"
            )
            lines.append(f"  {s.scorer.key} engine GPU: weights {_size(s.weights)}, static {_size(s.static)}; {where}")
        if self.host:
            lines.append("  a trainer rank's host memory:")
            lines += [f"    {name:<30}{_size(value):>12}" for name, value in self.host.items()]
        if self.colocated is not None:
            c = self.colocated
            lines += [
                "  colocated, per GPU, phases taking turns:",
                f"    {'trainer (above)':<30}{_size(self.trainer.total):>12}",
                f"    {'engines generate':<30}{_size(c.engines):>12}  (mem_fraction_static, and the trainer's "
                f"{_size(TRAINER_RESIDENT_BYTES)} resident: CUDA context, NCCL, assumed)",
                f"    {'weight handover':<30}{_size(c.push):>12}  (trainer and engine weights, a bucket, resident)",
                f"  host memory per node: {_size(sum(self.host.values()) * c.ranks + c.scorer_backup)} ({c.ranks} ranks"
                + (f", and {_size(c.scorer_backup)} of the scorer replicas' weights)" if c.scorer_backup else ")"),
            ]
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / (1 << 20):.1f} MiB"


def _rule_params(rule: TensorRule) -> int:
    return sum(math.prod(shape) for shape in rule.hf_shapes)


def _stage_params(
    family: ModelFamily,
    cfg: dict,
    tp: int,
    ep: int,
    etp: int,
    pp: int,
    stage: int,
    trainable: Callable[[TensorRule, float], float],
) -> tuple[int, int]:
    """(parameters, trained parameters) of one pipeline stage's rank."""
    layers = cfg["num_hidden_layers"] // pp
    rules = [r for i in range(stage * layers, (stage + 1) * layers) for r in family.layer_rules(cfg, i)]
    tied = cfg.get("tie_word_embeddings", False)
    for rule in family.global_rules(cfg):
        first = rule.mcore.startswith("embedding.")
        if (first and (stage == 0 or (tied and stage == pp - 1))) or (not first and stage == pp - 1):
            rules.append(rule)
    # a rank's share of a sharded tensor is a fraction: the sums are rounded once, at the end
    params: float = 0
    trained: float = 0
    for rule in rules:
        n: float = _rule_params(rule)
        if ".mlp.experts." in rule.mcore:
            n = n / ep / etp  # routed experts: each EP rank holds its share, split again over expert-TP
        elif any(part in rule.mcore for part in TP_SPLIT):
            n = n / tp
        params += n
        trained += trainable(rule, n)
    return int(params), int(trained)


def plan(
    cfg: RunConfig, model_config: dict, world: int, device_memory_gb: float, scorer_params: dict[str, int] | None = None
) -> MemoryPlan:
    """The plan for the job config ``cfg`` (a RunConfig) on ``world`` trainer ranks; ``scorer_params``: the parameters
    of each scorer's model by its section (``reward``, ``teacher``: :func:`~moerl.orchestrator.config.scorers`)."""
    from moerl.layout import Layout
    from moerl.models import family_for

    family = family_for(model_config)
    mc = family.normalize(model_config)
    t = cfg.trainer
    layout = Layout(tp=t.tp, pp=t.pp, ep=t.ep)
    dense_dp = world // (layout.tp * layout.pp)
    expert_dp = world // (layout.ep * layout.etp * layout.pp)
    lora = cfg.lora

    def trainable(rule: TensorRule, n: float) -> float:
        if not lora.enabled:
            return n
        if not lora.adapts(rule.mcore):
            return 0
        out_features = sum(shape[0] for shape in rule.hf_shapes)
        in_features = rule.hf_shapes[0][1]
        return n / (out_features * in_features) * lora.rank * (out_features + in_features)

    stages = [
        _stage_params(family, mc, layout.tp, layout.ep, layout.etp, layout.pp, s, trainable) for s in range(layout.pp)
    ]
    params, trained = max(stages)
    experts = sum(
        _rule_params(r)
        for i in range(mc["num_hidden_layers"])
        for r in family.layer_rules(mc, i)
        if ".mlp.experts." in r.mcore
    )
    expert_share = experts / layout.ep / layout.etp / layout.pp / max(params, 1)  # of this rank's parameters
    dtype_bytes = 4 if t.dtype == "float32" else 2
    distributed = t.optim.distributed_optimizer
    # fp32 master weights when training in bf16, and the two moments in their dtype
    moment_bytes = 2 if t.optim.moments_dtype == "bfloat16" else 4
    adam_bytes: float = ((4 if dtype_bytes == 2 else 0) + 2 * moment_bytes) * trained
    if distributed:
        adam_bytes = adam_bytes * (expert_share / expert_dp + (1 - expert_share) / dense_dp)
    terms: dict[str, float] = {
        "weights": params * dtype_bytes,
        "gradients (fp32)": 4 * trained,
        "optimizer state": adam_bytes,
    }
    if t.loss.kl_coef:
        terms["KL reference"] = trained * dtype_bytes
    mb = largest_micro_batch(cfg, mc)
    terms["activations (est.)"] = _activations(mc, t, layout, dtype_bytes, mb.tokens)
    terms["logits (fp32)"] = _logits(mc, layout, dtype_bytes, mb)
    if mb.attention == "local":
        terms["attention scores (s x s)"] = _attention_scores(mc, t, layout, dtype_bytes, mb)
    elif mb.attention == "flex":
        terms["attention rows (FlexAttention)"] = _flex_rows(mc, t, layout, dtype_bytes, mb)
    r = cfg.rollout
    # every response at its longest (an episode's: its whole stream, at most)
    response = r.max_episode_tokens if r.agent is not None else r.max_new_tokens
    step_tokens = r.groups_per_step * r.samples_per_prompt * response / dense_dp
    terms["loss inputs (a step, at most)"] = step_tokens * (
        LOSS_BYTES_PER_TOKEN + KEPT_ID_BYTES * r.top_k * t.replay.sampling_mask
    )
    placement = placement_of(cfg)
    host = _host_terms(cfg, placement, terms)
    device = device_memory_gb * GIB
    rank = RankMemory(params, trained, terms)
    problems: list[str] = []
    if rank.total > USABLE * device:
        largest = max(terms, key=lambda name: terms[name])
        problems.append(
            f"a trainer rank needs {rank.total / GIB:.1f} GiB of {USABLE * device / GIB:.1f} GiB usable "
            f"({device_memory_gb:g} GiB device, layout tp={t.tp} pp={t.pp} ep={t.ep} on {world} ranks); the largest "
            f"term is {largest} at {terms[largest] / GIB:.1f} GiB: "
            + _remedy(largest, mb.bound)
            + " (every term: "
            + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]))
            + ")"
        )

    e = cfg.engines
    engine_dtype = 4 if e.dtype == "float32" else 2
    # what a replica holds, and what a push sends: FP8 engines hold a byte per quantized weight and its block scales
    pushed = (
        fp8.hub_bytes(family.hub_shapes(mc), engine_dtype)
        if e.quantization == "fp8"
        else family.hub_numel(mc) * engine_dtype
    )
    engine_weights = pushed / e.gpus_per_replica
    if e.quantization == "fp8" and (problem := fp8.check_shards(family.hub_shapes(mc), e.gpus_per_replica)):
        problems.append(f"engines.quantization=fp8 with engines.gpus_per_replica={e.gpus_per_replica}: {problem}")
    if cfg.sync.delta:  # the pushed policy, which the next push is compared against
        host["delta pushes' last policy (global rank 0 only)"] = pushed
    kv_heads = mc["num_key_value_heads"]
    kv_per_token = (
        mc["num_hidden_layers"] * 2 * family.head_dim(mc) * engine_dtype * math.ceil(kv_heads / e.gpus_per_replica)
    )
    kv_budget = e.mem_fraction_static * device - engine_weights
    kv_tokens = max(0, int(kv_budget // kv_per_token)) if e.kv_tokens is None else e.kv_tokens
    senders = placement.senders(cfg, layout)  # each has a group with every engine GPU
    communicators = senders * MAX_GROUPS_PER_ENGINE * COMMUNICATOR_BYTES
    if not e.urls:  # engines running elsewhere: their memory is theirs
        problem = _engine_gpu_problem(
            cfg, device_memory_gb, engine_weights, kv_per_token, kv_budget, kv_tokens, communicators, senders
        )
        problems += [problem] if problem is not None else []
    scorers = _scorer_engines(cfg, placement, scorer_params or {}, device, problems)
    colocation = placement.phases(cfg, terms["weights"], engine_weights, scorers, world, device)
    if colocation is not None:
        problems += _colocation_problems(cfg, placement, colocation, device)
    return MemoryPlan(
        device,
        rank,
        engine_weights,
        kv_tokens,
        problems,
        mb,
        senders,
        communicators,
        colocation,
        host,
        scorers,
        placement.scorer_gpus(cfg),
    )


def _engine_gpu_problem(
    cfg: RunConfig,
    device_memory_gb: float,
    engine_weights: float,
    kv_per_token: int,
    kv_budget: float,
    kv_tokens: int,
    communicators: int,
    senders: int,
) -> str | None:
    """Why an engine GPU of the job's own replicas cannot hold what it must (None: it can): its weights, at least one
    group's KV cache, and the weight-sync communicators beside ``engines.mem_fraction_static``."""
    e = cfg.engines
    device = device_memory_gb * GIB
    group_tokens = cfg.rollout.samples_per_prompt * cfg.rollout.max_new_tokens
    floor = group_tokens * kv_per_token  # the least KV cache a replica may hold: one group's completions
    needed = engine_weights + floor + communicators
    if kv_budget <= 0:
        return (
            f"an engine GPU holds {engine_weights / GIB:.1f} GiB of weights, more than engines.mem_fraction_static="
            f"{e.mem_fraction_static} of {device_memory_gb:g} GiB: raise engines.gpus_per_replica (tensor parallelism)"
        )
    elif e.kv_tokens is not None and e.kv_tokens * kv_per_token > kv_budget:
        return (
            f"engines.kv_tokens={e.kv_tokens:,} takes {e.kv_tokens * kv_per_token / GIB:.1f} GiB of KV cache, more "
            f"than the {kv_budget / GIB:.1f} GiB engines.mem_fraction_static leaves beside the weights: lower it, or "
            "raise engines.gpus_per_replica or engines.mem_fraction_static"
        )
    elif kv_tokens < group_tokens:
        return (
            f"an engine replica's KV cache holds {kv_tokens:,} tokens, fewer than one group's completions "
            f"({cfg.rollout.samples_per_prompt} x {cfg.rollout.max_new_tokens}): raise engines.gpus_per_replica, "
            "engines.mem_fraction_static or engines.kv_tokens, or lower rollout.max_new_tokens"
        )
    elif needed > device:
        return (
            f"an engine GPU needs {needed / GIB:.1f} GiB of {device_memory_gb:g} GiB: weights "
            f"{engine_weights / GIB:.1f} GiB, the KV cache of one group's completions "
            f"{floor / GIB:.1f} GiB and {_size(communicators)} of weight-sync "
            f"communicators ({senders} senders x {MAX_GROUPS_PER_ENGINE} groups): raise "
            "engines.gpus_per_replica, lower rollout.max_new_tokens, send from fewer ranks (trainer.ep, "
            "trainer.pp) or set sync.method=disk"
        )
    elif communicators > (1 - e.mem_fraction_static) * device:
        return (
            f"an engine GPU's {_size(communicators)} of weight-sync communicators ({senders} senders x "
            f"{MAX_GROUPS_PER_ENGINE} groups) do not fit beside engines.mem_fraction_static="
            f"{e.mem_fraction_static} of {device_memory_gb:g} GiB: lower it to at most "
            f"{1 - communicators / device:.2f} (one group's KV cache fits down to "
            f"{(engine_weights + floor) / device:.2f}), or set sync.method=disk"
        )
    return None


def _scorer_engines(
    cfg: RunConfig, placement: Placement, params: dict[str, int], device: float, problems: list[str]
) -> list[ScorerMemory]:
    """Each started scorer's replica weights and static memory per GPU; ``problems`` gains weights that do not fit.
    SGLang takes its static memory as a fraction of what is free when it starts: colocated, the scorers' replicas start
    one pool after another beside the policy's engines and the trainer's resident part."""
    out: list[ScorerMemory] = []
    for scorer in started_scorers(cfg):
        e = scorer.engines
        weights = params.get(scorer.key, 0) * (4 if e.dtype == "float32" else 2) / e.gpus_per_replica
        room = placement.scorer_room(cfg, device, sum(s.static for s in out))
        static = e.mem_fraction_static * room
        if weights > static:
            colocated = placement.scorers_on_trainer_gpus(cfg)
            of = f"the {_size(room)} the engines started before it leave" if colocated else f"{device / GIB:g} GiB"
            problems.append(
                f"a {scorer.key} engine GPU holds {weights / GIB:.1f} GiB of weights, more than "
                f"{scorer.key}.engines.mem_fraction_static={e.mem_fraction_static} of {of}: raise "
                f"{scorer.key}.engines.gpus_per_replica (tensor parallelism)"
                + (f" or {scorer.key}.engines.mem_fraction_static" if colocated else "")
            )
        out.append(ScorerMemory(scorer, weights, static))
    return out


def _host_terms(cfg: RunConfig, placement: Placement, terms: dict[str, float]) -> dict[str, float]:
    """What a trainer rank keeps in host memory, by what: with trainer.optim.cpu_offload the optimizer state throughout
    (taken out of ``terms``, the device's), and what the placement moves (:meth:`Placement.trainer_terms`)."""
    host = {}
    if cfg.trainer.optim.cpu_offload:
        host["optimizer state"] = terms.pop("optimizer state")
    placement.trainer_terms(cfg, terms, host)
    return host


def _colocation_problems(cfg: RunConfig, placement: Placement, c: Colocation, device: float) -> list[str]:
    e = cfg.engines
    problems = []
    if e.replicas * e.gpus_per_replica > c.ranks:
        problems.append(
            f"colocated engines take {e.replicas} x {e.gpus_per_replica} GPUs, more than the {c.ranks} trainer ranks' "
            "GPUs they share: lower engines.replicas or engines.gpus_per_replica"
        )
    for scorer in started_scorers(cfg) if placement.scorers_on_trainer_gpus(cfg) else []:
        w, key = scorer.engines, scorer.key
        if scorer.gpus > c.ranks:
            problems.append(
                f"colocated {key} engines take {w.replicas} x {w.gpus_per_replica} GPUs, more than the {c.ranks} "
                f"trainer ranks' GPUs they share: lower {key}.engines.replicas or {key}.engines.gpus_per_replica"
            )
    if c.engines > device:
        problems.append(
            f"colocated engines' static memory (engines.mem_fraction_static={e.mem_fraction_static}) and the trainer's "
            f"{_size(TRAINER_RESIDENT_BYTES)} resident need {_size(c.engines)} of a {_size(device)} GPU: lower "
            f"engines.mem_fraction_static to at most {1 - TRAINER_RESIDENT_BYTES / device:.2f}"
        )
    if c.push > device:
        problems.append(
            f"the colocated weight handover needs {_size(c.push)} of a {_size(device)} GPU (the trainer's weights "
            "beside the engines'): shard the trainer further (trainer.ep, trainer.tp), raise engines.gpus_per_replica "
            "or lower sync.bucket_mb"
        )
    return problems


def largest_micro_batch(cfg: RunConfig, mc: dict) -> MicroBatchShape:
    """The largest micro-batch ``cfg`` allows. The packer fills a micro-batch up to ``micro_batch_tokens`` (padding
    included), and a sample longer than that is a micro-batch of its own; rows are rounded up to a multiple of the TP
    size. A padded micro-batch's rows are at most the longest sample; a packed one is a single row."""
    t = cfg.trainer
    sample, bound = longest_sample(cfg)
    longest = min(sample, mc.get("max_position_embeddings", math.inf))
    longest = -(-int(longest) // t.tp) * t.tp
    tokens = max(t.micro_batch_tokens, longest)
    # The logits copies at their peak (the loss's forward; its backward holds as many): the output layer's [s, b, V/tp],
    # GPTModel's transposed contiguous copy, the response rows gathered and their division by the temperature
    # (Trainer._scores). full_logprobs adds the shifted rows' exp, entropy() three more [T, V/tp]: the shifted rows,
    # their exp and the product; a distillation's top-k term (logprobs_at) one, its shifted rows' exp. Every copy is
    # counted at the micro-batch's size: a response fills all but its prompt.
    copies = 3 + (not t.replay.sampling_mask) + 3 * bool(t.loss.entropy_coef) + bool(t.loss.distill.top_k)
    return MicroBatchShape(
        tokens, tokens if t.micro_batch_format == "packed" else longest, longest, bound, copies, attention_kernel(cfg)
    )


def longest_sample(cfg: RunConfig) -> tuple[int, str]:
    """The most tokens a sample may hold, and the config key that bounds it: an agent's episode holds at most
    ``rollout.max_episode_tokens``, its prompt included; a single turn, a prompt of PROMPT_TOKENS and
    ``rollout.max_new_tokens``."""
    r = cfg.rollout
    if r.agent is not None:
        return r.max_episode_tokens, "rollout.max_episode_tokens"
    return PROMPT_TOKENS + r.max_new_tokens, "rollout.max_new_tokens"


def _bound_text(key: str) -> str:
    """What :func:`longest_sample`'s bounding ``key`` takes a sample as."""
    return f"a prompt taken as {PROMPT_TOKENS:,} + {key}" if key == "rollout.max_new_tokens" else key


ATTENTION = {
    "local": "megatron-core's local attention (s x s scores)",
    "flex": "FlexAttention over packed rows (no s x s scores)",
    "transformer_engine": "Transformer Engine's (no s x s scores)",
}


def attention_kernel(cfg: RunConfig) -> str:
    """What computes the trainer's attention on a GPU (a key of :data:`ATTENTION`). megatron-core's local layers, built
    for LoRA (it adapts those only) and on a CUDA machine without a usable Transformer Engine (a plan made without CUDA
    takes full fine-tuning to run on Transformer Engine's layers, as the GPU path does), take a packed row's segments to
    FlexAttention; a padded micro-batch to megatron-core's DotProductAttention, which materialises the
    ``[b, heads/tp, s, s]`` scores."""
    import torch

    from moerl.models.qwen_moe import te_usable

    if not cfg.lora.enabled and not (torch.cuda.is_available() and not te_usable()):
        return "transformer_engine"
    return "flex" if cfg.trainer.micro_batch_format == "packed" else "local"


def _activations(mc: dict, t: TrainerConfig, layout: Layout, dtype_bytes: int, tokens: int) -> float:
    """One micro-batch of ``tokens`` tokens, kept for the backward pass (an estimate): per layer, megatron's ~34 bytes
    per hidden unit per token (split over TP by sequence parallelism) plus the routed experts' inputs and outputs for
    top-k of the tokens; or, with full recompute, each layer's input plus one layer at a time. 1F1B keeps up to ``pp``
    micro-batches."""
    hidden = mc["hidden_size"]
    per_layer = tokens * hidden * 34 / layout.tp * dtype_bytes / 2
    per_layer += tokens * mc["num_experts_per_tok"] * (3 * mc["moe_intermediate_size"] + 2 * hidden) * dtype_bytes
    layers = mc["num_hidden_layers"] // layout.pp
    kept = layers * tokens * hidden * dtype_bytes / layout.tp + per_layer if t.recompute else layers * per_layer
    return kept * min(layout.pp, 2)


def _logits(mc: dict, layout: Layout, dtype_bytes: int, mb: MicroBatchShape) -> float:
    """The fp32 logits' copies (:func:`largest_micro_batch`), each ``[tokens, V/tp]``, and, training in bf16, the
    output layer's fp32 copy of its weight and that copy's gradient (log-probs are taken in fp32)."""
    vocab = mc["vocab_size"] / layout.tp
    weight = 2 * vocab * mc["hidden_size"] * 4 if dtype_bytes == 2 else 0
    return mb.logits_copies * mb.tokens * vocab * 4 + weight


def _attention_layers(mc: dict, t: TrainerConfig, layout: Layout) -> int:
    """The layers whose attention state one micro-batch keeps at once: every layer of the stage (1F1B: by up to two
    micro-batches, as for the activations) or, with full recompute, one layer at a time."""
    return 1 if t.recompute else mc["num_hidden_layers"] // layout.pp * min(layout.pp, 2)


def _attention_scores(mc: dict, t: TrainerConfig, layout: Layout, dtype_bytes: int, mb: MicroBatchShape) -> float:
    """megatron-core's local attention: per layer ``heads/tp x b x s x s`` scores, at most ``tokens x width`` per head
    (:data:`SCORE_BYTES`), kept by every layer of the stage (1F1B: by up to two micro-batches, as for the activations)
    or, with full recompute, by one layer at a time; and megatron-core's ``[s, s]`` causal masks
    (:data:`CAUSAL_MASK_TRANSIENT_BYTES`, a bool mask kept per layer)."""
    layers = _attention_layers(mc, t, layout)
    per = SCORE_BYTES[dtype_bytes]
    scores = mc["num_attention_heads"] / layout.tp * mb.tokens * mb.width
    masks = mb.width**2 * (layers + CAUSAL_MASK_TRANSIENT_BYTES)
    return scores * (per["buffer"] + per["kept"] * layers + per["transient"]) + masks


def _flex_rows(mc: dict, t: TrainerConfig, layout: Layout, dtype_bytes: int, mb: MicroBatchShape) -> float:
    """What FlexAttention keeps for the backward beyond the activations: per layer the queries, keys, values and
    output as contiguous rows padded to :func:`~moerl.megatron.segments.flex_width`, and the fp32 log-sum-exp per
    head and position; kept as the scores are (:func:`_attention_scores`)."""
    from moerl.megatron.segments import flex_width

    layers = _attention_layers(mc, t, layout)
    heads, groups = mc["num_attention_heads"] / layout.tp, mc["num_key_value_heads"] / layout.tp
    head_dim = mc.get("head_dim") or mc["hidden_size"] // mc["num_attention_heads"]
    per_position = (2 * heads + 2 * groups) * head_dim * dtype_bytes + heads * 4
    return layers * flex_width(mb.width) * per_position


def _remedy(term: str, key: str) -> str:
    """What shrinks ``term``; ``key``: the config key that bounds the longest sample (:func:`longest_sample`)."""
    longest = f"{key} (a sample longer than trainer.micro_batch_tokens is a micro-batch of its own)"
    return {
        "weights": "shard the model over more GPUs (raise trainer.ep for the experts, trainer.tp or trainer.pp), or "
        "train LoRA adapters (lora.enabled=true)",
        "gradients (fp32)": "shard the model over more GPUs (trainer.ep, trainer.tp, trainer.pp), or train LoRA "
        "adapters (lora.enabled=true)",
        "optimizer state": "keep it in host memory (trainer.optim.cpu_offload=true), or keep "
        "trainer.optim.distributed_optimizer=true and add data parallelism (more trainer GPUs: run.trainer_ranks, more "
        "nodes), or shard further (trainer.ep, trainer.tp, trainer.pp)",
        "KL reference": "set trainer.loss.kl_coef=0 (no reference model) or shard the model further",
        "activations (est.)": f"set trainer.recompute=true, or lower trainer.micro_batch_tokens or {longest}",
        "logits (fp32)": f"raise trainer.tp (it splits the vocabulary), or lower trainer.micro_batch_tokens or "
        f"{longest}; trainer.loss.entropy_coef=0 and trainer.replay.sampling_mask=true hold fewer "
        "copies",
        "attention scores (s x s)": "set trainer.micro_batch_format=packed (FlexAttention, no s x s scores), train "
        "on Transformer Engine's attention (full fine-tuning where transformer_engine is installed), set "
        f"trainer.recompute=true or raise trainer.tp, or lower trainer.micro_batch_tokens or {longest}",
        "attention rows (FlexAttention)": "set trainer.recompute=true or raise trainer.tp, or lower "
        f"trainer.micro_batch_tokens or {longest}",
        "released engine (assumed)": "run.placement=separate gives the engines GPUs of their own",
        "loss inputs (a step, at most)": "lower rollout.top_k (4 bytes a response token for each id of its kept set), "
        f"{key} or rollout.groups_per_step, or add data parallelism (run.trainer_ranks)",
    }[term]


def device_memory_gb(cfg: RunConfig) -> float:
    """``run.device_memory_gb``, else the visible GPU's memory, else 80 GB (an H100)."""
    if cfg.run.device_memory_gb:
        return cfg.run.device_memory_gb
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0


def plan_for(cfg: RunConfig, model_config: dict, world: int, scorer_params: dict[str, int] | None = None) -> MemoryPlan:
    return plan(cfg, model_config, world, device_memory_gb(cfg), scorer_params)


def check(cfg: RunConfig, model_config: dict, world: int, scorer_params: dict[str, int] | None = None) -> MemoryPlan:
    """The plan, or :class:`ConfigError` naming the term that does not fit and what to change."""
    result = plan_for(cfg, model_config, world, scorer_params)
    if result.problems:
        raise ConfigError("memory plan: " + "; ".join(result.problems))
    return result
