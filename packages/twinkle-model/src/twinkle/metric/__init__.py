"""twinkle.metric."""
