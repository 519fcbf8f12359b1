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

    # A sampler that runs beside the trainer (asynchronous RL, twinkle.rl.producer) takes `sync` in two
    # halves, on two threads: the trainer publishes after its step, the sampler applies between batches.
    def publish(self, model, adapter_name: str):
        """A snapshot of `model`'s adapter that later steps do not change, numbered with the next
        version (where the trainer runs); `apply` serves it."""
        raise NotImplementedError(f"{type(self).__name__} syncs in one call: it has no publish/apply halves")

    def apply(self, sampler, adapter_name: str, published) -> int:
        """Serve what `publish` returned as `adapter_name` (where the sampler runs); returns its version."""
        raise NotImplementedError(f"{type(self).__name__} syncs in one call: it has no publish/apply halves")


CHECKPOINT_ENGINES: Registry[CheckpointEngine] = Registry("checkpoint engine", GROUP, CheckpointEngine)
get_checkpoint_engine_class = CHECKPOINT_ENGINES.get
