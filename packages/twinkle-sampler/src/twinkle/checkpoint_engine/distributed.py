"""Trainer rank → sampler ranks over torch.distributed: one broadcast per dtype, adapter only.

Every rank of the group calls `sync` together. The source rank (holding the trainer) sends a JSON
header (module names, shapes, dtypes, scalings, version) and then the LoRA factors packed into one
flat buffer per dtype; the other ranks unpack views of that buffer (no further copy) and hand them to
their sampler. No pickle crosses the wire.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from twinkle.checkpoint_engine.base import CheckpointEngine
from twinkle.sampler.adapters import AdapterWeights, extract_adapter


def _broadcast_json(obj, src: int, group, device) -> dict:
    if dist.get_rank() == src:
        payload = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([payload.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    dist.broadcast(size, src, group=group)
    if dist.get_rank() != src:
        payload = torch.empty(int(size), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src, group=group)
    return json.loads(bytes(payload.cpu().tolist()).decode())


class BroadcastCheckpointEngine(CheckpointEngine):
    """`src`: the global rank holding the trainer. `device`: where buffers live (cpu for gloo, cuda for nccl)."""

    def __init__(self, src: int = 0, group=None, device: str | torch.device = "cpu"):
        super().__init__()
        self.src, self.group, self.device = src, group, torch.device(device)

    def sync(self, model, sampler, adapter_name: str, sampler_adapter_name: str | None = None) -> int:
        if not dist.is_initialized():
            raise RuntimeError("BroadcastCheckpointEngine needs torch.distributed initialised on every rank")
        is_src = dist.get_rank() == self.src
        target = sampler_adapter_name or adapter_name
        if is_src:
            if model is None:
                raise ValueError(f"rank {self.src} is the source: it must pass the trainer's model")
            weights = extract_adapter(model, adapter_name)
            entries = [
                (f"{m}.{w}", list(t.shape), str(t.dtype).removeprefix("torch."))
                for m in weights.modules
                for w, t in (("A", weights.lora_A[m]), ("B", weights.lora_B[m]))
            ]
            header = {"entries": entries, "scaling": weights.scaling, "version": self.next_version(target)}
        header = _broadcast_json(header if is_src else None, self.src, self.group, self.device)
        self.versions[target] = header["version"]
        by_dtype: dict[str, list] = {}
        for key, shape, dtype in header["entries"]:
            by_dtype.setdefault(dtype, []).append((key, shape))
        received: dict[str, torch.Tensor] = {}
        for dtype, items in sorted(by_dtype.items()):
            if is_src:
                flat = torch.cat([self._tensor(weights, key).reshape(-1).to(self.device) for key, _ in items])
            else:
                flat = torch.empty(
                    sum(torch.Size(s).numel() for _, s in items), dtype=getattr(torch, dtype), device=self.device
                )
            dist.broadcast(flat, self.src, group=self.group)
            offset = 0
            for key, shape in items:
                n = torch.Size(shape).numel()
                received[key] = flat[offset : offset + n].view(shape)
                offset += n
        if sampler is not None:
            if is_src:  # a sampler beside the trainer serves the trainer's own tensors
                sampler.set_adapter(target, weights, version=header["version"])
            else:
                modules = sorted(header["scaling"])
                sampler.set_adapter(
                    target,
                    AdapterWeights(
                        {m: received[f"{m}.A"] for m in modules},
                        {m: received[f"{m}.B"] for m in modules},
                        {m: float(s) for m, s in header["scaling"].items()},
                    ),
                    version=header["version"],
                )
        return header["version"]

    @staticmethod
    def _tensor(weights: AdapterWeights, key: str) -> torch.Tensor:
        module, which = key.rsplit(".", 1)
        return (weights.lora_A if which == "A" else weights.lora_B)[module].detach()
