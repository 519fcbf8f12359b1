"""twinkle-kit's `twinkle.model.transformers` import path: only its `moe.router_replay` names, ours."""
