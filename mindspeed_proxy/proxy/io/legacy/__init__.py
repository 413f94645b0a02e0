"""Legacy (torch) checkpoints: per-rank files and the expert key codecs."""
