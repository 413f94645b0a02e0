"""The bottom layer: errors, layouts, layer references, key grammar, Options and Plan types."""
