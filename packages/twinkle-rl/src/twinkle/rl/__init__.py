"""twinkle.rl."""
