"""Qwen2-MoE (``Qwen2MoeForCausalLM``): q/k/v biases and a sigmoid-gated shared expert per MoE layer."""

from __future__ import annotations

from moerl.models.qwen_moe import QwenMoeFamily, TensorRule, _glu_rules


class Qwen2MoeFamily(QwenMoeFamily):
    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    known_keys = QwenMoeFamily.known_keys | {
        "shared_expert_intermediate_size",
        "qkv_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
    required_keys = QwenMoeFamily.required_keys + ("shared_expert_intermediate_size",)

    def family_problems(self, cfg: dict) -> list[str]:
        problems = []
        if cfg.get("use_sliding_window", False) or any(t != "full_attention" for t in cfg.get("layer_types") or []):
            problems.append("sliding-window attention is not supported")
        if cfg.get("shared_expert_intermediate_size", 1) <= 0:
            problems.append("shared_expert_intermediate_size must be positive (Qwen2-MoE always has a shared expert)")
        return problems

    def family_config(self, cfg: dict) -> dict:
        return dict(
            qk_layernorm=False,
            # Qwen2-MoE checkpoints always carry q/k/v biases; transformers 5 names the switch qkv_bias.
            add_qkv_bias=bool(cfg.get("qkv_bias", True)),
            moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
            moe_shared_expert_gate=True,
            moe_shared_expert_overlap=False,
        )

    def layer_rules(self, cfg: dict, i: int) -> list[TensorRule]:
        rules = super().layer_rules(cfg, i)
        h, hd = cfg["hidden_size"], self.head_dim(cfg)
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        if cfg.get("qkv_bias", True):
            heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
            rules.append(
                TensorRule(
                    dst + "self_attention.linear_qkv.bias",
                    tuple(src + f"self_attn.{p}_proj.bias" for p in "qkv"),
                    ((heads * hd,), (groups * hd,), (groups * hd,)),
                    "qkv",
                )
            )
        if self.moe_layer_pattern(cfg)[i]:
            rules += _glu_rules(
                dst + "mlp.shared_experts.", src + "mlp.shared_expert.", h, cfg["shared_expert_intermediate_size"]
            )
            rules.append(
                TensorRule(dst + "mlp.shared_experts.gate_weight", (src + "mlp.shared_expert_gate.weight",), ((1, h),))
            )
        return rules


FAMILY = Qwen2MoeFamily()
