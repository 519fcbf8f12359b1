"""twinkle.client."""
