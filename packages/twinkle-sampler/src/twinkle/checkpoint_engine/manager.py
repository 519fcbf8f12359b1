"""twinkle-kit's `CheckpointEngineManager(model=model, sampler=sampler)`: after each training step,
`sync_weights()` makes the sampler sample what the trainer now holds, over our adapter-only engines.

twinkle-kit broadcasts weights over NCCL/HCCL between Ray actors; here the trainer's LoRA adapter moves:
in one process as a snapshot (`InProcessCheckpointEngine(copy=True)`: later steps do not reach the
sampler until the next sync), between Ray remote groups through a folder in the checkpoint format
(`FolderCheckpointEngine`). The sampler then serves it as its synced adapter: twinkle-kit's
`vLLMSampler.sample` with no adapter named samples it, as twinkle-kit's does; our samplers' own
`sample(..., adapter_name=manager.adapter_name)` names it.

`merge_and_sync=True` (twinkle-kit: merge the LoRA into the base and send every weight) and `False`
(base once, then the LoRA) both leave the sampler computing base + LoRA, which is what a merged base
computes; samplers here keep their own base and take adapters only, so a model training every weight
(no LoRA adapter) is refused by name.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from twinkle.checkpoint_engine.base import CheckpointEngine
from twinkle.checkpoint_engine.folder import FolderCheckpointEngine
from twinkle.checkpoint_engine.inprocess import InProcessCheckpointEngine

# twinkle-kit picks its collective (NCCL or HCCL) from the platform; adapters here need none
PLATFORMS = ("GPU", "CPU")


def _in_process(obj) -> bool:
    # A Ray remote group exposes methods only: a property read through it raises AttributeError.
    return hasattr(obj, "adapter_names") or hasattr(obj, "router")


class CheckpointEngineManager:
    """Moves `model`'s LoRA adapter to `sampler` on each `sync_weights()`; `adapter_name` is the name the
    sampler serves it under (the model's), `version` the number of syncs so far."""

    def __init__(self, model, sampler, platform: str = "GPU", checkpoint_dir: str | Path | None = None) -> None:
        """`checkpoint_dir`: where remote groups exchange adapter folders (default: a temporary folder)."""
        if str(platform).upper() not in PLATFORMS:
            raise ValueError(
                f"CheckpointEngineManager(platform={platform!r}): expected one of {list(PLATFORMS)} "
                "(the adapter moves without a collective, so the platform only has to be one we run on)"
            )
        self.model, self.sampler = model, sampler
        local = _in_process(model) and _in_process(sampler)
        if local:
            self.engine: CheckpointEngine = InProcessCheckpointEngine(copy=True)
        else:
            root = checkpoint_dir or tempfile.mkdtemp(prefix="twinkle-ckpt-sync-")
            self.engine = FolderCheckpointEngine(Path(root))
        self.adapter_name: str | None = None
        self.version = 0
        self.base_sync_done = False  # twinkle-kit's flag: True after the first sync

    def sync_weights(self, merge_and_sync: bool = True) -> int:
        """Make the sampler serve the model's adapter as it is now; returns the new version."""
        if not isinstance(merge_and_sync, bool):
            raise TypeError(f"sync_weights(merge_and_sync={merge_and_sync!r}): expected True or False")
        name = self.adapter_name or self._model_adapter()
        if isinstance(self.engine, InProcessCheckpointEngine):
            self.version = self.engine.sync(self.model, self.sampler, name)
        else:
            self.version = self.engine.apply(self.sampler, name, self.engine.publish(self.model, name))
        self.sampler.set_synced_adapter(name)
        self.adapter_name, self.base_sync_done = name, True
        return self.version

    def _model_adapter(self) -> str:
        names = self.model.get_info().get("adapters")
        if not names:
            raise NotImplementedError(
                "CheckpointEngineManager.sync_weights: the model has no LoRA adapter; samplers here keep their "
                "own base and take adapters only, so a model training every weight is not synced "
                "(add_adapter_to_model first, or save() the model and build the sampler from that folder)"
            )
        if len(names) > 1:
            raise ValueError(
                f"CheckpointEngineManager.sync_weights: the model holds adapters {names}; twinkle-kit's "
                "manager syncs one: build it on a model with one adapter, or sync with "
                "twinkle.checkpoint_engine.InProcessCheckpointEngine().sync(model, sampler, name)"
            )
        return names[0]
