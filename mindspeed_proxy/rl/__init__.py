"""GRPO post-training of megatron-core MoE policies: tasks, sampler, routing replay, update, metrics."""
