"""Checkpoint formats (legacy, torch_dist, Hugging Face) and the file plumbing they share."""
