"""TwinkleModel: the training API every backend implements (Transformers, Megatron).

The user's loop drives it: forward_backward → clip_grad_and_step → calculate_metric → save.
Every method takes `adapter_name` (which LoRA, when several exist; None = the only one, or the
whole model when there is no adapter).
"""

from __future__ import annotations

from typing import Any


class TwinkleModel:
    def forward_backward(self, inputs, adapter_name: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def forward_only(self, inputs, adapter_name: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def clip_grad_and_step(self, max_grad_norm: float = 1.0, adapter_name: str | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def set_optimizer(self, optimizer_cls="AdamW", adapter_name: str | None = None, **kwargs) -> None:
        raise NotImplementedError

    def set_lr_scheduler(self, scheduler_cls, adapter_name: str | None = None, **kwargs) -> None:
        raise NotImplementedError

    def set_loss(self, loss, adapter_name: str | None = None, **kwargs) -> None:
        raise NotImplementedError

    def calculate_metric(self, is_training: bool = True, adapter_name: str | None = None) -> dict[str, float]:
        raise NotImplementedError

    def save(self, path, adapter_name: str | None = None, save_training_state: bool = False,
             data_position: int | None = None) -> str:
        raise NotImplementedError

    def load(self, path, adapter_name: str | None = None) -> None:
        raise NotImplementedError
