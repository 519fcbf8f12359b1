"""`Torch.is_gpu_available()` / `is_npu_available()`: which accelerator this process can use (twinkle-kit's
names; scripts branch on them to pick kernels and synchronise devices)."""

from __future__ import annotations

import importlib.util

import torch


class Torch:
    @staticmethod
    def is_gpu_available() -> bool:
        return torch.cuda.is_available()

    @staticmethod
    def is_npu_available() -> bool:
        """Ascend NPUs need the torch_npu plugin; without it there is no NPU to use."""
        if importlib.util.find_spec("torch_npu") is None:
            return False
        import torch_npu  # noqa: F401 - registers torch.npu

        return bool(torch.npu.is_available())  # ty: ignore[missing-attribute] - torch_npu adds it
