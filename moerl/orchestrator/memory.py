"""The memory plan: what each trainer rank and each engine GPU will hold, from the model's config.json
alone, checked before anything is launched.

Per trainer rank (the worst pipeline stage): the model's weights in the training dtype, fp32 gradient
buffers, Adam's state (an fp32 master copy when training in bf16, and two moments), divided over data
parallelism by the distributed optimizer, the KL reference's copy of the weights, an estimate of one
micro-batch's activations, and the loss's inputs for a whole step at most (kept sets included). Per engine GPU:
the weights and the KV cache left within SGLang's ``mem_fraction_static``. The plan is for GPUs of ``run.device_memory_gb`` (default: the visible GPU's
memory, else 80 GB), with ``auto`` dtypes meaning bf16 as they do on a GPU, so it can be made anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from moerl.errors import ConfigError

GIB = 1 << 30
USABLE = 0.9  # of a trainer GPU: the CUDA context, NCCL buffers and fragmentation take the rest
# Per response token, the loss's inputs that a rank holds on its device for a whole piece (MicroBatch.loss_inputs_to;
# a sync step is one piece): rows, cols, targets, seq, versions and the kept sets' offsets in int64; temperature,
# weights, advantages, the engine's, the proximal and the reference log-probs in float32; routing_differs. Each kept id
# adds 4 bytes (int32).
LOSS_BYTES_PER_TOKEN = 6 * 8 + 6 * 4 + 1
KEPT_ID_BYTES = 4
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
class MemoryPlan:
    device_bytes: float
    trainer: RankMemory
    engine_weights: float  # bytes per engine GPU
    engine_kv_tokens: int  # tokens of KV cache each replica holds
    problems: list[str]

    def table(self) -> str:
        lines = [f"memory plan (device {self.device_bytes / GIB:.0f} GiB; trainer ranks use up to {USABLE:.0%}):",
                 f"  trainer rank: {self.trainer.params:,} parameters ({self.trainer.trainable:,} trained)"]
        lines += [f"    {name:<22}{_size(value):>12}" for name, value in self.trainer.terms.items()]
        lines.append(f"    {'total':<22}{_size(self.trainer.total):>12}")
        lines.append(f"  engine GPU: weights {_size(self.engine_weights)}, KV cache for {self.engine_kv_tokens:,} tokens per replica")
        return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / (1 << 20):.1f} MiB"


def _rule_params(rule) -> int:
    return sum(math.prod(shape) for shape in rule.hf_shapes)


def _stage_params(family, cfg: dict, tp: int, ep: int, etp: int, pp: int, stage: int, trainable) -> tuple[int, int]:
    """(parameters, trained parameters) of one pipeline stage's rank."""
    layers = cfg["num_hidden_layers"] // pp
    rules = [r for i in range(stage * layers, (stage + 1) * layers) for r in family.layer_rules(cfg, i)]
    tied = cfg.get("tie_word_embeddings", False)
    for rule in family.global_rules(cfg):
        first = rule.mcore.startswith("embedding.")
        if (first and (stage == 0 or (tied and stage == pp - 1))) or (not first and stage == pp - 1):
            rules.append(rule)
    params = trained = 0
    for rule in rules:
        n = _rule_params(rule)
        if ".mlp.experts." in rule.mcore:
            n = n / ep / etp  # routed experts: each EP rank holds its share, split again over expert-TP
        elif any(part in rule.mcore for part in TP_SPLIT):
            n = n / tp
        params += n
        trained += trainable(rule, n)
    return int(params), int(trained)


def plan(cfg, model_config: dict, world: int, device_memory_gb: float) -> MemoryPlan:
    """The plan for the job config ``cfg`` (a RunConfig) on ``world`` trainer ranks."""
    from moerl.layout import Layout
    from moerl.models import family_for

    family = family_for(model_config)
    mc = family.normalize(model_config)
    t = cfg.trainer
    layout = Layout(tp=t.tp, pp=t.pp, ep=t.ep)
    dense_dp = world // (layout.tp * layout.pp)
    expert_dp = world // (layout.ep * layout.etp * layout.pp)
    lora = cfg.lora

    def trainable(rule, n) -> float:
        if not lora.enabled:
            return n
        if not lora.adapts(rule.mcore):
            return 0
        out_features = sum(shape[0] for shape in rule.hf_shapes)
        in_features = rule.hf_shapes[0][1]
        return n / (out_features * in_features) * lora.rank * (out_features + in_features)

    stages = [_stage_params(family, mc, layout.tp, layout.ep, layout.etp, layout.pp, s, trainable) for s in range(layout.pp)]
    params, trained = max(stages)
    experts = sum(_rule_params(r) for i in range(mc["num_hidden_layers"]) for r in family.layer_rules(mc, i) if ".mlp.experts." in r.mcore)
    expert_share = experts / layout.ep / layout.etp / layout.pp / max(params, 1)  # of this rank's parameters
    dtype_bytes = 4 if t.dtype == "float32" else 2
    distributed = t.optim.distributed_optimizer
    adam_bytes = (12 if dtype_bytes == 2 else 8) * trained
    if distributed:
        adam_bytes = adam_bytes * (expert_share / expert_dp + (1 - expert_share) / dense_dp)
    terms = {
        "weights": params * dtype_bytes,
        "gradients (fp32)": 4 * trained,
        "optimizer state": adam_bytes,
    }
    if t.loss.kl_coef:
        terms["KL reference"] = trained * dtype_bytes
    terms["activations (est.)"] = _activations(mc, t, layout, dtype_bytes)
    r = cfg.rollout
    step_tokens = r.groups_per_step * r.samples_per_prompt * r.max_new_tokens / dense_dp  # every response at its longest
    terms["loss inputs (a step, at most)"] = step_tokens * (LOSS_BYTES_PER_TOKEN + KEPT_ID_BYTES * r.top_k * t.replay.sampling_mask)
    device = device_memory_gb * GIB
    rank = RankMemory(params, trained, terms)
    problems = []
    if rank.total > USABLE * device:
        largest = max(terms, key=terms.get)
        problems.append(
            f"a trainer rank needs {rank.total / GIB:.1f} GiB of {USABLE * device / GIB:.1f} GiB usable ({device_memory_gb:g} GiB device, "
            f"layout tp={t.tp} pp={t.pp} ep={t.ep} on {world} ranks); the largest term is {largest} at {terms[largest] / GIB:.1f} GiB: "
            + _remedy(largest) + " (every term: " + ", ".join(f"{k} {v / GIB:.1f} GiB" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])) + ")")

    e = cfg.engines
    engine_dtype = 4 if e.dtype == "float32" else 2
    total = family.hub_numel(mc)
    engine_weights = total * engine_dtype / e.gpus_per_replica
    kv_heads = mc["num_key_value_heads"]
    kv_per_token = mc["num_hidden_layers"] * 2 * family.head_dim(mc) * engine_dtype * math.ceil(kv_heads / e.gpus_per_replica)
    kv_budget = e.mem_fraction_static * device - engine_weights
    kv_tokens = max(0, int(kv_budget // kv_per_token))
    group_tokens = cfg.rollout.samples_per_prompt * cfg.rollout.max_new_tokens
    if e.urls:
        pass  # engines running elsewhere: their memory is theirs
    elif kv_budget <= 0:
        problems.append(f"an engine GPU holds {engine_weights / GIB:.1f} GiB of weights, more than engines.mem_fraction_static="
                        f"{e.mem_fraction_static} of {device_memory_gb:g} GiB: raise engines.gpus_per_replica (tensor parallelism)")
    elif kv_tokens < group_tokens:
        problems.append(f"an engine replica's KV cache holds {kv_tokens:,} tokens, fewer than one group's completions "
                        f"({cfg.rollout.samples_per_prompt} x {cfg.rollout.max_new_tokens}): raise engines.gpus_per_replica "
                        "or engines.mem_fraction_static, or lower rollout.max_new_tokens")
    return MemoryPlan(device, rank, engine_weights, kv_tokens, problems)


def _activations(mc: dict, t, layout, dtype_bytes: int) -> float:
    """One micro-batch of ``micro_batch_tokens`` tokens, kept for the backward pass (an estimate): per layer,
    megatron's ~34 bytes per hidden unit per token (split over TP by sequence parallelism) plus the routed
    experts' inputs and outputs for top-k of the tokens; or, with full recompute, each layer's input plus
    one layer at a time. Plus the fp32 logits and their gradient, and, training in bf16, the output layer's fp32 copy
    of its weight and that copy's gradient (log-probs are taken in fp32). 1F1B keeps up to ``pp`` micro-batches."""
    tokens, hidden = t.micro_batch_tokens, mc["hidden_size"]
    per_layer = tokens * hidden * 34 / layout.tp * dtype_bytes / 2
    per_layer += tokens * mc["num_experts_per_tok"] * (3 * mc["moe_intermediate_size"] + 2 * hidden) * dtype_bytes
    layers = mc["num_hidden_layers"] // layout.pp
    kept = layers * tokens * hidden * dtype_bytes / layout.tp + per_layer if t.recompute else layers * per_layer
    logits = 2 * tokens * mc["vocab_size"] / layout.tp * 4
    if dtype_bytes == 2:
        logits += 2 * mc["vocab_size"] / layout.tp * hidden * 4
    return kept * min(layout.pp, 2) + logits


def _remedy(term: str) -> str:
    return {
        "weights": "shard the model over more GPUs (raise trainer.ep for the experts, trainer.tp or trainer.pp), or train "
                   "LoRA adapters (lora.enabled=true)",
        "gradients (fp32)": "shard the model over more GPUs (trainer.ep, trainer.tp, trainer.pp), or train LoRA adapters (lora.enabled=true)",
        "optimizer state": "keep trainer.optim.distributed_optimizer=true and add data parallelism (more trainer GPUs: "
                           "run.trainer_ranks, more nodes), or shard further (trainer.ep, trainer.tp, trainer.pp)",
        "KL reference": "set trainer.loss.kl_coef=0 (no reference model) or shard the model further",
        "activations (est.)": "set trainer.recompute=true or lower trainer.micro_batch_tokens",
        "loss inputs (a step, at most)": "lower rollout.top_k (4 bytes a response token for each id of its kept set), "
                                         "rollout.max_new_tokens or rollout.groups_per_step, or add data parallelism (run.trainer_ranks)",
    }[term]


def device_memory_gb(cfg) -> float:
    """``run.device_memory_gb``, else the visible GPU's memory, else 80 GB (an H100)."""
    if cfg.run.device_memory_gb:
        return cfg.run.device_memory_gb
    import torch

    return torch.cuda.get_device_properties(0).total_memory / GIB if torch.cuda.is_available() else 80.0


def plan_for(cfg, model_config: dict, world: int) -> MemoryPlan:
    return plan(cfg, model_config, world, device_memory_gb(cfg))


def check(cfg, model_config: dict, world: int) -> MemoryPlan:
    """The plan, or :class:`ConfigError` naming the term that does not fit and what to change."""
    result = plan_for(cfg, model_config, world)
    if result.problems:
        raise ConfigError("memory plan: " + "; ".join(result.problems))
    return result
