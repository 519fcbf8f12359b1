"""twinkle.template."""
