"""twinkle-kit's `twinkle.model.transformers.moe.router_replay` import path: our routing replay
(`twinkle.model.router_replay`)."""

from twinkle.model.router_replay import RouterReplayAction

__all__ = ["RouterReplayAction"]
