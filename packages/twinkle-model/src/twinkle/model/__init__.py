"""twinkle.model."""
