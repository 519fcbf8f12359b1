"""twinkle.loss."""
