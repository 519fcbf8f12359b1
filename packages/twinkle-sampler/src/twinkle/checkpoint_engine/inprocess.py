"""Trainer and sampler in one process: the sampler serves the trainer's LoRA tensors themselves.

With `copy=False` (default) nothing is copied when device and dtype match: the sampler's adapter
tensors *are* the trainer's parameters, so optimizer steps (in place) reach the sampler at once and
`sync` only bumps the version (and re-links if the trainer replaced its parameters). That fits the
synchronous RL loop (sample, train, sync, sample). For a sampler that keeps running while the trainer
steps, use `copy=True`: each sync snapshots the adapter, so samples match their reported version.
`publish` always snapshots (a published version must stay what it was), `apply` installs it.
"""

from __future__ import annotations

from twinkle.checkpoint_engine.base import CheckpointEngine
from twinkle.sampler.adapters import AdapterWeights, extract_adapter


class InProcessCheckpointEngine(CheckpointEngine):
    def __init__(self, copy: bool = False):
        super().__init__()
        self.copy = copy

    def sync(self, model, sampler, adapter_name: str, sampler_adapter_name: str | None = None) -> int:
        target = sampler_adapter_name or adapter_name
        weights = extract_adapter(model, adapter_name)
        if self.copy:
            weights = weights.clone()
        version = self.next_version(target)
        sampler.set_adapter(target, weights, version=version)
        return version

    def publish(self, model, adapter_name: str) -> AdapterWeights:
        weights = extract_adapter(model, adapter_name).clone()
        weights.version = self.next_version(adapter_name)
        return weights

    def apply(self, sampler, adapter_name: str, published: AdapterWeights) -> int:
        return sampler.set_adapter(adapter_name, published, version=published.version)
