"""Qwen3-MoE (``Qwen3MoeForCausalLM``): q/k RMSNorm per head, no biases, optional dense layers."""

from __future__ import annotations

from moerl.models.qwen_moe import QwenMoeFamily, TensorRule


class Qwen3MoeFamily(QwenMoeFamily):
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    known_keys = QwenMoeFamily.known_keys | {
        "attention_bias",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }

    def family_problems(self, cfg: dict) -> list[str]:
        problems = []
        if cfg.get("attention_bias", False):
            problems.append("attention_bias=true (no released Qwen3-MoE uses it; megatron would bias the MLP too)")
        if cfg.get("use_sliding_window", False) or any(t != "full_attention" for t in cfg.get("layer_types") or []):
            problems.append("sliding-window attention is not supported")
        return problems

    def family_config(self, cfg: dict) -> dict:
        return dict(qk_layernorm=True, add_qkv_bias=False)

    def layer_rules(self, cfg: dict, i: int) -> list[TensorRule]:
        hd = self.head_dim(cfg)
        src, dst = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
        return super().layer_rules(cfg, i) + [
            TensorRule(dst + "q_layernorm.weight", (src + "q_norm.weight",), ((hd,),)),
            TensorRule(dst + "k_layernorm.weight", (src + "k_norm.weight",), ((hd,),)),
        ]


FAMILY = Qwen3MoeFamily()
