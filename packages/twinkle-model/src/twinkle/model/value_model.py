"""TransformersValueModel (twinkle-kit's name): a causal LM whose unembedding is a scalar value head, for
PPO's critic. Its pass gives V_t per position ([B, T], aligned with the targets: the value of the prefix
before target t) through `twinkle.loss.ValueHead`, which the value losses (MSELoss, PPOValueLoss) read;
no vocabulary-sized logits are ever computed.

The head is a Linear(hidden, 1) with a bias, zero at the start (every value 0), replacing the output
projection where it was, so it saves and loads as part of the model. Trained in full (as twinkle-kit's
critic is) it is one of the model's parameters; with a LoRA adapter (which twinkle-kit refuses) it is
trained beside the adapter as the adapter's own full copy (peft's `modules_to_save`), written into and
read back from the adapter folder.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from twinkle.data_format.loss_inputs import completion_values
from twinkle.loss import LogitsHead, TokenHead, ValueHead
from twinkle.mesh import remote_method
from twinkle.model import inputs as model_inputs
from twinkle.model.base import MODELS
from twinkle.model.transformers_model import TransformersModel, refuse_logits

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PreTrainedModel

    from twinkle.data_format.loss_inputs import PerRow, Rows
    from twinkle.model.router_replay import RouterReplayAction
    from twinkle.model.vision import TrainVision


def install_value_head(hf_model: PreTrainedModel) -> str:
    """Replace `hf_model`'s output projection by a zeroed Linear(hidden, 1); returns its module name."""
    old = hf_model.get_output_embeddings()
    if not isinstance(old, torch.nn.Linear):
        raise ValueError(f"a value head replaces a Linear output projection; this model has {type(old).__name__}")
    head = torch.nn.Linear(old.in_features, 1, bias=True, device=old.weight.device, dtype=old.weight.dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    name = next(n for n, m in hf_model.named_modules() if m is old)
    hf_model.set_output_embeddings(head)
    # the input embeddings no longer share the head's weight: saving and loading must keep both
    hf_model.config.tie_word_embeddings = False
    return name


@MODELS.register
class TransformersValueModel(TransformersModel):
    """A value model: `forward_only` returns per-row values aligned with labels; `forward_backward`
    trains the value head (and the adapter or the whole model) on a value loss."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:  # TransformersModel's
        super().__init__(*args, **kwargs)
        self.value_head_name = install_value_head(self.hf_model)

    @remote_method()
    def add_adapter_to_model(
        self,
        adapter_name: str,
        config: LoraConfig,
        gradient_accumulation_steps: int = 1,
        *,
        train_vision: TrainVision = (),
    ) -> None:
        """A LoRA adapter whose value head is its own trained copy (saved with it)."""
        saved = list(config.modules_to_save or [])
        if self.value_head_name not in saved:
            config = copy.copy(config)
            config.modules_to_save = [*saved, self.value_head_name]
        super().add_adapter_to_model(adapter_name, config, gradient_accumulation_steps, train_vision=train_vision)

    def forward_backward(
        self,
        inputs: Rows,
        adapter_name: str | None = None,
        *,
        returns: PerRow | None = None,
        old_values: PerRow | None = None,
        **kit: Any,
    ) -> dict:
        """twinkle-kit's critic keywords: `returns` / `old_values`, per row a number or one value per
        completion token (labels not -100), become the rows' loss inputs; the rest is TransformersModel's."""
        named = {"returns": returns, "old_values": old_values}
        given = {k: v for k, v in named.items() if v is not None}
        if given:
            rows = [inputs] if isinstance(inputs, Mapping) else list(inputs)
            clash = sorted({k for r in rows for k in given if k in r})
            if clash:
                raise ValueError(f"the rows already carry {clash}: pass them either in the rows or as keywords")
            columns = {k: completion_values(rows, v, k) for k, v in given.items()}
            inputs = [{**r, **{k: col[i] for k, col in columns.items()}} for i, r in enumerate(rows)]
        return super().forward_backward(inputs, adapter_name, **kit)

    def _run(
        self, module: torch.nn.Module, batch: dict[str, torch.Tensor], drop_last: bool = True, task: str = "causal_lm"
    ) -> TokenHead:
        if task != "causal_lm":
            raise ValueError(f"a value model runs task='causal_lm' only, got task={task!r}")
        head = super()._run(module, batch, drop_last)
        if not isinstance(head, LogitsHead):  # a one-wide head is never chunked, unless a patch forces it
            raise ValueError("a value model's head cannot be computed in chunks (ChunkedCrossEntropy patch)")
        return ValueHead(head.logits_B_T_V[..., 0].float())

    @remote_method(dispatch="slice", collect="merge")
    def forward_only(
        self,
        inputs: Rows,
        adapter_name: str | None = None,
        *,
        disable_lora: bool = False,
        task: str = "causal_lm",
        return_logits: bool = False,
        router_replay_action: RouterReplayAction | str | None = None,
        micro_batch_size: int | None = None,
    ) -> dict:
        """Per row, V before each token (aligned with labels, 0 at position 0), and the loss when it is
        a value loss whose inputs (`returns`, ...) the rows carry; `micro_batch_size` as TransformersModel's."""
        if micro_batch_size is not None and not isinstance(inputs, Mapping) and len(inputs) > micro_batch_size:
            return self.micro_batched_forward_only(list(inputs), adapter_name, micro_batch_size, task=task)
        refuse_logits(return_logits)
        if router_replay_action is not None:
            raise ValueError("router_replay_action: a value model's forward_only neither records nor replays routing")
        if disable_lora:
            raise ValueError("a value model has no reference pass: disable_lora=True is for a policy's LoRA")
        state = self._state(adapter_name)
        t0 = time.perf_counter()
        with torch.no_grad():
            ctx = self.forward(inputs, adapter_name, _grad=False, task=task)
            needed = state.loss.required_fields
            out = self.calculate_loss(ctx, adapter_name) if needed and set(needed) <= set(ctx.fields) else None
        self._record(state, ctx, out, time.perf_counter() - t0, training=False)
        values_B_T = ctx.head.values()
        spans = model_inputs.sequence_spans(ctx.batch)
        self.last_eval_loss = float(out.loss) if out is not None else None
        return {
            "loss": self.last_eval_loss,
            "values": [[0.0, *values_B_T[b, s : s + n - 1].tolist()] for b, s, n in spans],
        }
