"""CheckpointEngine: moves one LoRA adapter from a trainer's model to a sampler, with a version.

Adapter-only by design: a sync moves the LoRA factors (kilobytes to megabytes), never a merged base
model. Every sync bumps the adapter's version, and every sample the sampler returns reports the
version that produced it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from twinkle.registry import Registry

GROUP = "twinkle.checkpoint_engine"


class CheckpointEngine(ABC):
    def __init__(self):
        self.versions: dict[str, int] = {}

    def next_version(self, adapter_name: str) -> int:
        self.versions[adapter_name] = self.versions.get(adapter_name, 0) + 1
        return self.versions[adapter_name]

    @abstractmethod
    def sync(self, model, sampler, adapter_name: str, sampler_adapter_name: str | None = None) -> int:
        """Make `sampler` serve `model`'s adapter `adapter_name` (under `sampler_adapter_name`, default
        the same name); returns the new version."""


CHECKPOINT_ENGINES: Registry[CheckpointEngine] = Registry("checkpoint engine", GROUP, CheckpointEngine)
get_checkpoint_engine_class = CHECKPOINT_ENGINES.get
