"""twinkle.dataset."""
