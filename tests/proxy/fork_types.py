"""A type that another Megatron fork might keep in its args: not in megatron-core's safe globals."""
import enum


class ForkBackend(enum.Enum):
    """Stands for a fork's own enum in `args` (e.g. an attention-backend choice of its own)."""

    FAST = "fast"
    SAFE = "safe"
