"""Proxy construction: clustering-based, structure-preserving expert pruning of Megatron MoE checkpoints."""
from mindspeed_proxy.proxy.core.errors import ConversionError

__all__ = ["ConversionError"]
