"""The only code that touches torch / megatron-core / MindSpeed internals (installed as `mindspeed_proxy.patches`)."""
