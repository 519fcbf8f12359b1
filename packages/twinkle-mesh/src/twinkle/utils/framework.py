"""`Torch.is_gpu_available()` / `is_npu_available()`: which accelerator this process can use (twinkle-kit's
names; scripts branch on them to pick kernels and synchronise devices)."""

from __future__ import annotations

import torch


class Torch:
    @staticmethod
    def is_gpu_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def is_npu_available() -> bool:
        """Ascend NPUs need the torch_npu plugin, which registers `torch.npu` once the program imports it
        (no member declares it, so nothing here imports it on the program's behalf)."""
        npu = getattr(torch, "npu", None)
        return npu is not None and bool(npu.is_available())
