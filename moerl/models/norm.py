"""RMSNorm for the local (non Transformer Engine) megatron-core spec.

megatron-core's fallback ``WrappedTorchNorm`` refuses sequence parallelism, which MoE with TP>1
requires, and apex's fused norm needs CUDA. This one computes exactly what Hugging Face Qwen
models compute (fp32 statistics, weight applied in the input dtype), so logits match bit for bit in
fp32, and it tags its weight for megatron's sequence-parallel gradient all-reduce.

It checkpoints an extra state (empty) where Transformer Engine's norm (TENorm) checkpoints its quantization
state: megatron-core saves a module's extra state as a sharded object, which a model built with TE asks the
checkpoint for, so a checkpoint written with either spec holds it.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        if config.normalization != "RMSNorm":
            raise ValueError(f"moerl RMSNorm built for normalization={config.normalization!r}")
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # finalize_model_grads all-reduces, across TP ranks, the grads of params marked so:
        # with sequence parallelism each rank saw only its slice of the sequence. (torch's Parameter type declares none
        # of the attributes megatron-core tags parameters with.)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]  # torch types no tags

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        return self.weight * hidden_states.to(input_dtype)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """Nothing to restore: what TE's norm saves is its quantization (FP8) state, which this norm has none of."""
