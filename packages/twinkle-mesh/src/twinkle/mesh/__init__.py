"""twinkle.mesh."""
