"""Hosts other than megatron-core: the mechanism monitor on Hugging Face MoE models (DeepSpeed ZeRO, plain DP)."""
