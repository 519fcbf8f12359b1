"""Trainer → sampler through a folder both can read, in the one checkpoint format (a PEFT folder).

For a trainer and a sampler that live in other processes and expose only their public methods: Ray
remote groups (`TransformersModel(remote_group='model')`, `TorchSampler(remote_group='sampler')`) on
one node, or on nodes that share a filesystem. `publish` asks the model to `save` its adapter under
`root/<adapter>-v<version>`; `apply` asks the sampler to `load_adapter` it with that version. A LoRA
folder is kilobytes to megabytes, so the write costs little beside a training step. Folders older
than the newest one a sampler has applied are removed at the next publish.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

from twinkle.checkpoint_engine.base import CheckpointEngine


class FolderCheckpointEngine(CheckpointEngine):
    def __init__(self, root: str | Path):
        super().__init__()
        self.root = Path(root)
        self._applied: dict[str, int] = {}
        self._lock = threading.Lock()  # publish and apply run on two threads in asynchronous RL

    def publish(self, model, adapter_name: str) -> dict:
        with self._lock:
            version = self.next_version(adapter_name)
            applied = self._applied.get(adapter_name, 0)
        for old in self.root.glob(f"{adapter_name}-v*"):
            number = old.name.removeprefix(f"{adapter_name}-v")
            if number.isdigit() and int(number) < applied:
                shutil.rmtree(old, ignore_errors=True)
        path = self.root / f"{adapter_name}-v{version}"
        model.save(str(path), adapter_name=adapter_name)
        return {"path": str(path), "version": version}

    def apply(self, sampler, adapter_name: str, published: dict) -> int:
        version = sampler.load_adapter(adapter_name, published["path"], version=published["version"])
        with self._lock:
            self._applied[adapter_name] = max(self._applied.get(adapter_name, 0), version)
        return version

    def sync(self, model, sampler, adapter_name: str, sampler_adapter_name: str | None = None) -> int:
        return self.apply(sampler, sampler_adapter_name or adapter_name, self.publish(model, adapter_name))
