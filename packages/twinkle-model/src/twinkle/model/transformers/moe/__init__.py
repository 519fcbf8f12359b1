"""twinkle-kit's `twinkle.model.transformers.moe` import path (`router_replay`)."""
