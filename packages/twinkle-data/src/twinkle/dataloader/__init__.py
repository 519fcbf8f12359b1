"""twinkle.dataloader: mesh-aware, resumable batches of rows."""

from twinkle.dataloader.dataloader import DataLoader, default_check

__all__ = ["DataLoader", "default_check"]
