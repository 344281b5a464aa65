"""What Qwen3-MoE and Qwen2-MoE share: config checks, the megatron-core config and spec, and the
declarative HF <-> Megatron tensor map that the family modules extend.

A family is described by a :class:`QwenMoeFamily` subclass; its mapping is a list of
:class:`TensorRule` per layer, each naming one full (TP1/EP1) megatron parameter and the Hub tensors
it is made of. The converter and the tests walk these rules; nothing else knows HF names.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from moerl.errors import ConfigError
from moerl.layout import UNSHARDED, Layout, LayoutError
from moerl.models.family import ModelShape, TensorRule

# megatron-core is imported where a model is built: the engines' and the rollout manager's processes, which read only
# the tensor map, start without it (about 2 s each on 2 cores).
if TYPE_CHECKING:
    from megatron.core.transformer.transformer_config import TransformerConfig

# Keys of every transformers config that never change the forward math.
_GENERIC_KEYS = frozenset(
    """architectures model_type transformers_version torch_dtype dtype bos_token_id eos_token_id
    pad_token_id use_cache initializer_range output_router_logits router_aux_loss_coef
    max_position_embeddings _name_or_path id2label label2id return_dict output_hidden_states
    output_attentions chunk_size_feed_forward is_encoder_decoder problem_type tokenizer_class
    attention_dropout router_jitter_noise""".split()
)


_HUB_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def te_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def _replace_norms(spec: Any, norm_types: tuple[type, ...]) -> Any:
    """Swap megatron's fallback norms for moerl's RMSNorm throughout a (nested) spec."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from moerl.models.norm import RMSNorm

    if isinstance(spec, type) and issubclass(spec, norm_types):
        return RMSNorm
    if isinstance(spec, ModuleSpec):
        if isinstance(spec.module, type) and issubclass(spec.module, norm_types):
            spec.module = RMSNorm
        if spec.submodules is not None:
            spec.submodules = _replace_norms(spec.submodules, norm_types)
        return spec
    if hasattr(spec, "__dataclass_fields__"):
        for field in spec.__dataclass_fields__:
            setattr(spec, field, _replace_norms(getattr(spec, field), norm_types))
        return spec
    if isinstance(spec, list):
        return [_replace_norms(s, norm_types) for s in spec]
    return spec


def _checkpoint_keys_as_te(block: Any) -> Any:
    """Make the local spec checkpoint every norm under Transformer Engine's key, so a checkpoint loads
    under either spec. Its layers save ``input_layernorm`` and ``pre_mlp_layernorm`` under the names of
    TE's fused layer-norm linears; but TE fuses the pre-MLP norm only into a dense MLP's ``linear_fc1``,
    and a MoE layer keeps it as ``pre_mlp_layernorm``, so the MoE layers' rename is dropped."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    for layer in block.layer_specs:
        mlp = layer.submodules.mlp
        if isinstance(mlp, ModuleSpec) and isinstance(mlp.module, type) and issubclass(mlp.module, MoELayer):
            keys = dict(layer.submodules.sharded_state_dict_keys_map)
            keys.pop("pre_mlp_layernorm.", None)
            layer.submodules.sharded_state_dict_keys_map = keys
    return block


def _fallback_norm_types() -> tuple[type, ...]:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    types: list[type] = [WrappedTorchNorm]
    try:
        from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

        types.append(FusedLayerNorm)
    except ImportError:
        pass
    return tuple(types)


class QwenMoeFamily:
    """Base of the Qwen MoE families. Subclasses set the names and extend the checks and rules."""

    architecture: str
    model_type: str
    #: Keys the family reads (in addition to _GENERIC_KEYS); anything else is refused.
    known_keys: frozenset[str] = frozenset(
        """vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads
        num_key_value_heads head_dim hidden_act rms_norm_eps tie_word_embeddings rope_theta
        rope_parameters rope_scaling decoder_sparse_step moe_intermediate_size num_experts_per_tok
        num_experts norm_topk_prob mlp_only_layers""".split()
    )
    required_keys: tuple[str, ...] = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "moe_intermediate_size",
        "num_experts_per_tok",
        "num_experts",
    )

    # ---- config ---------------------------------------------------------------------------
    @staticmethod
    def normalize(cfg: dict) -> dict:
        """transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``; the Hub uses
        ``num_experts``. Everything below reads ``num_experts``."""
        cfg = dict(cfg)
        if "num_local_experts" in cfg:
            local = cfg.pop("num_local_experts")
            if cfg.setdefault("num_experts", local) != local:
                raise ConfigError(f"num_experts={cfg['num_experts']} and num_local_experts={local} disagree")
        return cfg

    def check(self, cfg: dict) -> None:
        """Refuse, with one message naming every problem, what the Megatron model cannot reproduce."""
        problems: list[str] = []
        arch = cfg.get("architectures") or [self.architecture]
        if arch != [self.architecture]:
            problems.append(f"architectures={arch}, expected [{self.architecture!r}]")
        missing = [k for k in self.required_keys if k not in cfg]
        if missing:
            problems.append(f"missing required keys: {', '.join(missing)}")
        unknown = sorted(set(cfg) - self.known_keys - _GENERIC_KEYS)
        if unknown:
            problems.append(f"unsupported keys (they may change the math): {', '.join(unknown)}")
        if cfg.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={cfg['hidden_act']!r}: only 'silu' is supported")
        rope = self._rope_parameters(cfg)
        if rope.get("rope_type", "default") != "default" or set(rope) - {"rope_theta", "rope_type"}:
            problems.append(f"rope scaling {rope}: only plain RoPE (rope_type 'default') is supported")
        if not missing:
            if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
                problems.append("num_attention_heads is not a multiple of num_key_value_heads")
            if not 0 < cfg["num_experts_per_tok"] <= cfg["num_experts"]:
                problems.append("num_experts_per_tok must be in [1, num_experts]")
            pattern = self._pattern_or_none(cfg, problems)
            if pattern is not None and not any(pattern):
                problems.append("no MoE layer: mlp_only_layers/decoder_sparse_step leave only dense layers")
        problems += self.family_problems(cfg)
        if problems:
            raise ConfigError(f"{self.architecture} config not supported: " + "; ".join(problems))

    def family_problems(self, cfg: dict) -> list[str]:
        return []

    @staticmethod
    def _rope_parameters(cfg: dict) -> dict:
        rope = dict(cfg.get("rope_parameters") or {})
        if cfg.get("rope_scaling"):
            rope.update(cfg["rope_scaling"])
            rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        return rope

    def _pattern_or_none(self, cfg: dict, problems: list[str]) -> list[int] | None:
        step = cfg.get("decoder_sparse_step", 1)
        if not isinstance(step, int) or step < 1:
            problems.append(f"decoder_sparse_step={step!r} must be a positive integer")
            return None
        bad = [i for i in cfg.get("mlp_only_layers", []) if not 0 <= i < cfg["num_hidden_layers"]]
        if bad:
            problems.append(f"mlp_only_layers has layers outside the model: {bad}")
            return None
        return self.moe_layer_pattern(cfg)

    @staticmethod
    def moe_layer_pattern(cfg: dict) -> list[int]:
        """1 for a MoE layer, 0 for a dense one, exactly as transformers decides."""
        step = cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers", []))
        return [
            int(i not in dense and cfg["num_experts"] > 0 and (i + 1) % step == 0)
            for i in range(cfg["num_hidden_layers"])
        ]

    def model_shape(self, cfg: dict) -> ModelShape:
        pattern = self.moe_layer_pattern(cfg)
        return ModelShape(
            cfg["num_hidden_layers"],
            cfg["num_experts_per_tok"],
            [i for i, moe in enumerate(pattern) if moe],
            cfg["num_experts"],
        )

    @staticmethod
    def head_dim(cfg: dict) -> int:
        return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]

    def check_layout(self, cfg: dict, layout: Layout) -> None:
        problems = []
        if cfg["num_attention_heads"] % layout.tp:
            problems.append(f"num_attention_heads={cfg['num_attention_heads']} not divisible by TP={layout.tp}")
        if cfg["num_key_value_heads"] % layout.tp:
            problems.append(f"num_key_value_heads={cfg['num_key_value_heads']} not divisible by TP={layout.tp}")
        if cfg["vocab_size"] % layout.tp:
            problems.append(f"vocab_size={cfg['vocab_size']} not divisible by TP={layout.tp}")
        if cfg["num_experts"] % layout.ep:
            problems.append(f"num_experts={cfg['num_experts']} not divisible by EP={layout.ep}")
        if cfg["num_hidden_layers"] % layout.pp:
            problems.append(f"num_hidden_layers={cfg['num_hidden_layers']} not divisible by PP={layout.pp}")
        for key in ("moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size"):
            size = cfg.get(key)
            divisor = layout.etp if key == "moe_intermediate_size" else layout.tp
            if size and size % divisor:
                problems.append(f"{key}={size} not divisible by {'ETP' if divisor is layout.etp else 'TP'}={divisor}")
        if problems:
            raise LayoutError(f"layout {layout} does not fit this model: " + "; ".join(problems))

    # ---- megatron-core ----------------------------------------------------------------------
    def transformer_config(
        self, cfg: dict, layout: Layout = UNSHARDED, dtype: torch.dtype = torch.float32, **overrides
    ) -> TransformerConfig:
        self.check(cfg)
        self.check_layout(cfg, layout)
        kwargs = dict(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            num_attention_heads=cfg["num_attention_heads"],
            num_query_groups=cfg["num_key_value_heads"],
            kv_channels=self.head_dim(cfg),
            ffn_hidden_size=cfg["intermediate_size"],
            normalization="RMSNorm",
            layernorm_epsilon=cfg.get("rms_norm_eps", 1e-6),
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=cfg.get("attention_dropout", 0.0),
            num_moe_experts=cfg["num_experts"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="none",
            moe_layer_freq=self.moe_layer_pattern(cfg),
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=te_usable(),
            moe_enable_routing_replay=True,
            moe_router_fusion=False,
            moe_permute_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=layout.etp,
            sequence_parallel=layout.sequence_parallel,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            pipeline_dtype=dtype,
            use_cpu_initialization=not torch.cuda.is_available(),
        )
        kwargs.update(self.family_config(cfg))
        kwargs.update(overrides)
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(**kwargs)
        self.refuse_silent_replay_skips(config)
        return config

    def family_config(self, cfg: dict) -> dict:
        return {}

    @staticmethod
    def refuse_silent_replay_skips(config: TransformerConfig) -> None:
        """megatron-core skips RouterReplay without a word on these paths: refuse them."""
        if config.moe_router_fusion:
            raise ConfigError("moe_router_fusion=True bypasses RouterReplay; moerl needs replay")
        if config.moe_router_load_balancing_type == "sinkhorn":
            raise ConfigError("sinkhorn routing bypasses RouterReplay; moerl needs replay")
        if not config.moe_enable_routing_replay:
            raise ConfigError("moe_enable_routing_replay must stay on")

    def layer_spec(
        self,
        config: TransformerConfig,
        vp_stage: int | None = None,
        pp_rank: int | None = None,
        transformer_engine: bool | None = None,
    ):
        """The decoder's spec: Transformer Engine's layers where it is usable (and not refused), else
        megatron-core's local layers."""
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        te = te_usable() if transformer_engine is None else transformer_engine and te_usable()
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage, pp_rank=pp_rank
        )
        return spec if te else _checkpoint_keys_as_te(_replace_norms(spec, _fallback_norm_types()))

    def gpt_model_kwargs(self, cfg: dict) -> dict:
        return dict(
            vocab_size=cfg["vocab_size"],
            max_sequence_length=cfg.get("max_position_embeddings", 4096),
            share_embeddings_and_output_weights=bool(cfg.get("tie_word_embeddings", False)),
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=self._rope_parameters(cfg)["rope_theta"],
        )

    # ---- HF mapping ------------------------------------------------------------------------
    def global_rules(self, cfg: dict) -> list[TensorRule]:
        vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
        rules = [
            TensorRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), ((vocab, hidden),)),
            TensorRule("decoder.final_layernorm.weight", ("model.norm.weight",), ((hidden,),)),
        ]
        if not cfg.get("tie_word_embeddings", False):
            rules.append(TensorRule("output_layer.weight", ("lm_head.weight",), ((vocab, hidden),)))
        return rules

    def layer_rules(self, cfg: dict, i: int) -> list[TensorRule]:
        h, hd = cfg["hidden_size"], self.head_dim(cfg)
        heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        rules = [
            TensorRule(dst + "input_layernorm.weight", (src + "input_layernorm.weight",), ((h,),)),
            TensorRule(
                dst + "self_attention.linear_qkv.weight",
                tuple(src + f"self_attn.{p}_proj.weight" for p in "qkv"),
                ((heads * hd, h), (groups * hd, h), (groups * hd, h)),
                "qkv",
            ),
            TensorRule(
                dst + "self_attention.linear_proj.weight", (src + "self_attn.o_proj.weight",), ((h, heads * hd),)
            ),
            TensorRule(dst + "pre_mlp_layernorm.weight", (src + "post_attention_layernorm.weight",), ((h,),)),
        ]
        if self.moe_layer_pattern(cfg)[i]:
            n, f = cfg["num_experts"], cfg["moe_intermediate_size"]
            rules.append(TensorRule(dst + "mlp.router.weight", (src + "mlp.gate.weight",), ((n, h),)))
            for e in range(n):
                rules += _glu_rules(dst + f"mlp.experts.local_experts.{e}.", src + f"mlp.experts.{e}.", h, f)
        else:
            rules += _glu_rules(dst + "mlp.", src + "mlp.", h, cfg["intermediate_size"])
        return rules

    def weight_layers(self, cfg: dict) -> list[tuple[str, list[TensorRule]]]:
        layers = [("", self.global_rules(cfg))]
        return layers + [(f"decoder.layers.{i}.", self.layer_rules(cfg, i)) for i in range(cfg["num_hidden_layers"])]

    def hub_numel(self, cfg: dict) -> int:
        """Elements of the whole HF checkpoint (what a full-weight sync moves), from the shapes alone."""
        return sum(math.prod(shape) for shape in self.hub_shapes(cfg).values())

    def hub_shapes(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        return {
            name: shape for rule in self.all_rules(cfg) for name, shape in zip(rule.hf, rule.hf_shapes, strict=True)
        }

    def all_rules(self, cfg: dict) -> list[TensorRule]:
        return [rule for _, rules in self.weight_layers(cfg) for rule in rules]

    def to_mcore(self, rule: TensorRule, tensors: list[torch.Tensor], cfg: dict) -> torch.Tensor:
        """Fuse the Hub tensors of one rule into the full megatron parameter."""
        if rule.kind == "copy":
            return tensors[0]
        if rule.kind == "concat":
            return torch.cat(tensors, dim=0)
        q, k, v = tensors
        groups = cfg["num_key_value_heads"]
        tail = q.shape[1:]
        per_group = [t.reshape(groups, -1, *tail) for t in (q, k, v)]
        return torch.cat(per_group, dim=1).reshape(-1, *tail).contiguous()

    @staticmethod
    def transformers_slot(hub_name: str) -> tuple[str, tuple]:
        """Where a Hub tensor lives in a transformers 5 model: ``(parameter name, index)``.

        transformers 5 fuses each layer's experts in memory (``experts.gate_up_proj`` [E, 2F, H] as
        [gate; up] per expert, ``experts.down_proj`` [E, H, F]); everything else keeps its Hub name.
        """
        match = _HUB_EXPERT.match(hub_name)
        if not match:
            return hub_name, ()
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        if proj == "down_proj":
            return f"{prefix}down_proj", (expert,)
        half = 0 if proj == "gate_proj" else 1
        return f"{prefix}gate_up_proj", (expert, half)

    def to_hf(self, rule: TensorRule, tensor: torch.Tensor, cfg: dict) -> list[torch.Tensor]:
        """Split one full megatron parameter back into its Hub tensors."""
        if rule.kind == "copy":
            return [tensor]
        if rule.kind == "concat":
            return [t.contiguous() for t in torch.split(tensor, [s[0] for s in rule.hf_shapes], dim=0)]
        groups, hd = cfg["num_key_value_heads"], self.head_dim(cfg)
        q_rows = cfg["num_attention_heads"] // groups * hd
        tail = tensor.shape[1:]
        q, k, v = torch.split(tensor.reshape(groups, q_rows + 2 * hd, *tail), [q_rows, hd, hd], dim=1)
        return [t.reshape(-1, *tail).contiguous() for t in (q, k, v)]


def _glu_rules(dst: str, src: str, hidden: int, ffn: int) -> list[TensorRule]:
    return [
        TensorRule(
            dst + "linear_fc1.weight",
            (src + "gate_proj.weight", src + "up_proj.weight"),
            ((ffn, hidden), (ffn, hidden)),
            "concat",
        ),
        TensorRule(dst + "linear_fc2.weight", (src + "down_proj.weight",), ((hidden, ffn),)),
    ]
