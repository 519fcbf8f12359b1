"""twinkle.processor."""
