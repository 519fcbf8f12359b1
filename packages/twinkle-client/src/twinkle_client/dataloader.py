"""twinkle-kit's client DataLoader: ours (twinkle.dataloader), reading on this machine (see
twinkle_client.dataset for why)."""

from __future__ import annotations

try:
    from twinkle.dataloader import DataLoader
except ImportError as e:
    raise ImportError("twinkle_client.dataloader reads data here: pip install 'twinkle-client[local-encoding]'") from e

__all__ = ["DataLoader"]
