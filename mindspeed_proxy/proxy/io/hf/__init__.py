"""Hugging Face safetensors checkpoints: layout and reader/writer."""
