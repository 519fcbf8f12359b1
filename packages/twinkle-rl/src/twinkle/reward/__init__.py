"""twinkle.reward."""
