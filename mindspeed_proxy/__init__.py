"""mindspeed-proxy: mechanism-driven monitors and MoE proxy models for Megatron-core / MindSpeed."""

__version__ = "0.1.0"
