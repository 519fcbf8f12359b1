"""twinkle.sampler."""
