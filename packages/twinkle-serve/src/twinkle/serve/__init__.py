"""twinkle.serve."""
