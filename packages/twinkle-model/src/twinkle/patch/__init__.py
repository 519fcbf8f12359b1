"""twinkle.patch."""
