"""The GRPO trainer on megatron-core: batching, routing replay, kept-set log-probs, objectives, steps."""
