"""Trainer actor → sampler actor through the Ray object store, adapter only.

The trainer side `publish`es the LoRA factors as numpy arrays (`ray.put`, so the store holds them
once, however many sampler actors read them); the sampler side `apply`s what it receives: Ray hands
numpy arrays out of the shared-memory store without copying, and `torch.from_numpy` wraps them.
Ray is optional (`twinkle-mesh[ray]`); this module imports it only when used.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from twinkle.checkpoint_engine.base import CheckpointEngine
from twinkle.sampler.adapters import AdapterWeights, extract_adapter


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("RayCheckpointEngine needs Ray: pip install 'twinkle-mesh[ray]'") from e
    return ray


def adapter_to_payload(weights: AdapterWeights, version: int) -> dict:
    # numpy has no bfloat16: such tensors travel as float32 and come back as bfloat16.
    def arr(t):
        t = t.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()

    return {
        "A": {m: arr(t) for m, t in weights.lora_A.items()},
        "B": {m: arr(t) for m, t in weights.lora_B.items()},
        "scaling": dict(weights.scaling),
        "version": version,
        "dtype": str(next(iter(weights.lora_A.values())).dtype).removeprefix("torch."),
    }


def payload_to_adapter(payload: dict) -> AdapterWeights:
    dtype = getattr(torch, payload["dtype"])
    with warnings.catch_warnings():
        # Arrays read from the object store are read-only views; the sampler never writes to them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(dtype)

        return AdapterWeights(
            {m: tensor(a) for m, a in payload["A"].items()},
            {m: tensor(a) for m, a in payload["B"].items()},
            dict(payload["scaling"]),
            version=payload["version"],
        )


class RayCheckpointEngine(CheckpointEngine):
    """`publish` runs where the trainer lives, `apply` where the sampler lives; `sync` drives actors."""

    def publish(self, model, adapter_name: str):
        """Put the adapter into the object store; returns its ObjectRef (inside the trainer actor)."""
        weights = extract_adapter(model, adapter_name)
        return _ray().put(adapter_to_payload(weights, self.next_version(adapter_name)))

    @staticmethod
    def apply(sampler, adapter_name: str, published: dict) -> int:
        """Serve a published adapter (inside the sampler actor; Ray resolved the ObjectRef already)."""
        return sampler.set_adapter(adapter_name, payload_to_adapter(published), version=published["version"])

    def sync(self, model, sampler, adapter_name: str, sampler_adapter_name: str | None = None) -> int:
        """`model` and `sampler` are actor handles exposing `publish_adapter(name)` and
        `apply_adapter(name, payload)` (thin wrappers over `publish` / `apply`)."""
        ray = _ray()
        ref = ray.get(model.publish_adapter.remote(adapter_name))  # the ObjectRef the trainer put
        return ray.get(sampler.apply_adapter.remote(sampler_adapter_name or adapter_name, ref))
