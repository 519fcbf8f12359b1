"""twinkle.checkpoint_engine."""
