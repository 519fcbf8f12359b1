"""twinkle.kernel: twinkle-kit's kernel swap (`kernelize(model, mapping)`), with nothing to swap in here.

twinkle-kit replaces layers with Liger (Triton) or Ascend NPU kernels. Neither is offered: the mapping
builders refuse by name, and `kernelize` with an empty mapping (what a script builds on a machine with
neither) returns the model unchanged, so a script that only asks for them when it can runs as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import torch

M = TypeVar("M", bound="torch.nn.Module")


def liger_builtin(model: torch.nn.Module) -> dict:
    raise NotImplementedError(
        "Liger kernels are not offered (twinkle-kit's --enable-liger): leave it off; ChunkedCrossEntropy "
        "(model.apply_patch) keeps the logits small instead"
    )


def npu_builtin(model: torch.nn.Module) -> dict:
    raise NotImplementedError("Ascend NPU kernels are not offered: there is no NPU backend here")


def kernelize(model: M, mapping: dict) -> M:
    """The model unchanged for an empty mapping; a non-empty one is refused (no kernels to swap in)."""
    if mapping:
        raise NotImplementedError(f"no kernels to swap in for {sorted(mapping)}: kernelize takes an empty mapping here")
    return model
