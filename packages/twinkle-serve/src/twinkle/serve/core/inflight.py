"""Inflight sampling (Tinker SDK 0.38 `kind="inflight"`): one mutable weights target per training model,
shared by every inflight sampling session of that model.

An inflight save publishes the model's current weights as the target's next version: a sampler snapshot
installed under that version's own name, after which the previous version is retired (removed at once,
or when the last decode that began on it ends). A sample of an inflight session runs on the target's
newest version when it starts, so on weights at least as new as the session's creation, and a sample
spanning an update finishes on the weights it began with. The save waits for no sample: a long decode
hands the engine back between its steps (core/slices.py), and the save runs there.

Each inflight session is its own prefix-cache namespace (its sampler id): two sessions never share KV,
and each save makes a new session, so a new namespace even when no optimizer step came between. Cache
entries are keyed by the weights as well (twinkle.sampler.prefix_cache), so after an update a session
reuses none of the KV computed under the older version.

Targets are held in memory, like the sampler weights they name: after a restart, or once the training
model is unloaded, an inflight session answers that its weights are gone.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Published:
    """One version of a training model's inflight target."""

    model_id: str
    version: int  # 1, 2, ...: one per inflight save
    adapter: str  # the sampler adapter serving it
    policy_steps: int  # the model's optimizer steps when it was published (the samples' policy version)


def target_adapter(model_id: str, version: int) -> str:
    return f"i{hashlib.sha1(model_id.encode()).hexdigest()[:16]}v{version}"


class InflightTargets:
    def __init__(self):
        self._lock = threading.Lock()
        self._targets: dict[str, Published] = {}  # model id -> its newest version
        self._sessions: dict[str, str] = {}  # inflight sampler id -> the model id it follows

    def publish(self, backend, model_id: str, live_adapter: str, policy_steps: int, sampler_id: str) -> Published:
        """On the engine's worker (an inflight save's work): install the live adapter's current weights as
        the next version, retire the previous one, and open the inflight session `sampler_id` on it."""
        with self._lock:
            old = self._targets.get(model_id)
            version = 1 if old is None else old.version + 1
            new = Published(model_id, version, target_adapter(model_id, version), policy_steps)
            backend.install_sampler_from_adapter(new.adapter, live_adapter)
            self._targets[model_id] = new
            self._sessions[sampler_id] = model_id
        if old is not None:
            backend.retire_sampler(old.adapter)
        return new

    def follows(self, sampler_id: str) -> bool:
        """Whether `sampler_id` is an inflight session of a target still open."""
        with self._lock:
            return sampler_id in self._sessions

    def newest(self, sampler_id: str) -> Published | None:
        """The version an inflight session samples on now; None for any other sampler."""
        with self._lock:
            model_id = self._sessions.get(sampler_id)
            return None if model_id is None else self._targets.get(model_id)

    def close(self, backend, model_id: str) -> None:
        """The training model is unloaded: its target goes (its sessions answer that their weights are gone)."""
        with self._lock:
            old = self._targets.pop(model_id, None)
            self._sessions = {s: m for s, m in self._sessions.items() if m != model_id}
        if old is not None:
            backend.retire_sampler(old.adapter)
