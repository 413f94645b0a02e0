"""Bit-exact verification of a written proxy against its source."""
