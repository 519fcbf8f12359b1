"""twinkle.dataloader."""
