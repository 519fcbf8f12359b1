"""The server-wide cap on LoRA adapter memory (`max_adapter_memory_mb`): estimate, reserve, refuse.

An adapter's cost is known before it is built: rank x (in + out) parameters for every targeted
Linear of the base model, each held four times (weights, gradients, two Adam moments). A new
adapter that would push the live total past the cap is refused with a clear error, instead of
letting the server run out of memory mid-step.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from twinkle.serve.backend import LoraSpec
from twinkle.serve.errors import ApiError

COPIES = 4  # weights, grads, Adam exp_avg, exp_avg_sq


class AdapterMemoryFull(ApiError):
    status = 409


def _linears(module):
    """(name, Linear) for the base model's Linears; a layer a LoRA already wraps counts as its inner Linear."""
    import torch

    for name, m in module.named_modules():
        linear = getattr(m, "base_layer", m)
        if isinstance(linear, torch.nn.Linear) and not name.endswith(".base_layer"):
            yield name, linear


def linear_dims(module) -> dict[str, int]:
    """{leaf name (q_proj, lm_head, ...): sum of in + out features over the base model's Linears}."""
    dims: dict[str, int] = defaultdict(int)
    for name, m in _linears(module):
        dims[name.rsplit(".", 1)[-1]] += m.in_features + m.out_features
    return dict(dims)


class AdapterMemory:
    """One server-wide account: every route that builds an adapter (Tinker create_model, native
    add_adapter_to_model / load) reserves under its own key first and releases it when freed."""

    def __init__(self, cap_mb: float | None):
        self.cap = None if cap_mb is None else int(cap_mb * 2**20)
        self._held: dict[str, int] = {}
        self._dims: dict[int, dict[str, int]] = {}
        self._lock = threading.Lock()

    def estimate(self, backend, spec, element_bytes: int = 4) -> int | None:
        """Bytes for a Tinker `LoraSpec`, or for a peft `LoraConfig` (the native API's, which may name
        modules by list, regex or 'all-linear'; matched exactly as the multi-LoRA engine will)."""
        base = backend.base_module
        if base is None:  # a backend whose base model is not in this process: no estimate, no cap
            return None
        if isinstance(spec, LoraSpec):
            dims = self._dims.setdefault(id(backend), linear_dims(base))
            return sum(dims.get(t, 0) for t in spec.target_modules()) * spec.rank * element_bytes * COPIES
        from twinkle.model.multi_lora.spec import AdapterSpec

        chosen = set(AdapterSpec.from_lora_config(spec).select(base))  # ValueError: the caller's config
        width = sum(m.in_features + m.out_features for name, m in _linears(base) if name in chosen)
        return width * spec.r * element_bytes * COPIES

    def reserve(self, key: str, backend, spec) -> None:
        if self.cap is None:
            return
        need = self.estimate(backend, spec)
        if need is None:
            return
        rank = spec.rank if isinstance(spec, LoraSpec) else spec.r
        with self._lock:
            used = sum(v for k, v in self._held.items() if k != key)
            if used + need > self.cap:
                raise AdapterMemoryFull(
                    f"adapter memory is full: this LoRA (rank {rank}) needs {need / 2**20:.2f} MiB, "
                    f"{used / 2**20:.2f} MiB of the server's {self.cap / 2**20:.2f} MiB (max_adapter_memory_mb) "
                    "are in use; finish a session (or close a model) to free its adapters, or use a smaller rank"
                )
            self._held[key] = need

    def used(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def release(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)
