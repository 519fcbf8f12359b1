"""CheckpointEngine: moves one LoRA adapter from a trainer's model to a sampler, with a version.

Adapter-only by design: a sync moves the LoRA factors (kilobytes to megabytes), never a merged base
model. Every sync bumps the adapter's version, and every sample the sampler returns reports the
version that produced it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from importlib.metadata import entry_points

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


def get_checkpoint_engine_class(name: str) -> type:
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in found:
        raise KeyError(f"unknown checkpoint engine {name!r}; known: {sorted(found)}")
    return found[name].load()
