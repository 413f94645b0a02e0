"""torch_dist checkpoints: index, chunk reader, reader and writer."""
