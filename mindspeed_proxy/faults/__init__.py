"""Fault injectors: numerical emulators that reproduce known training failures (pure torch, no Megatron)."""
