"""twinkle-kit's DPO over the Tinker API (its cookbook client/tinker/dpo.py), served as ours.

twinkle-kit's server adds two conventions to Tinker's, and its DPO script needs both:
- a `forward` named 'cross_entropy' whose loss_fn_config has `disable_lora` (nonzero) answers the base
  model's log-probs: the adapter switched off, as the reference of a LoRA run;
- a `forward_backward` named 'importance_sampling' whose datums carry `ref_logps` (those log-probs) and
  neither `logprobs` nor `advantages` is DPO: `twinkle.loss.DPOLoss` (`dpo_beta`, `dpo_loss_type`, `dpo_sft_weight`)
  over (chosen, rejected) datums in consecutive pairs, scored where `weights` is nonzero (the reply), summed
  over pairs as Tinker's losses are sums.
Anything else in such a request's loss_fn_config is refused by name. A request without these markers is
Tinker's, untouched: `importance_sampling` without `ref_logps` still needs `logprobs` and `advantages`.

The reference forward runs the pass with a loss that asks the engine for the reference log-probs (as
DPO does when it is not sent them) and hands those on as the pass's log-probs, so it costs a second
forward over the rows.
"""

from __future__ import annotations

from twinkle.loss import IGNORE_INDEX, CrossEntropyLoss, DPOLoss, Loss, LossContext
from twinkle.serve.backend.base import UserError

DPO_CONFIG = ("dpo_beta", "dpo_loss_type", "dpo_sft_weight")  # twinkle-kit's defaults: 0.1, sigmoid, 0


class BaseModelCrossEntropy(CrossEntropyLoss):
    """Cross-entropy of the base model: the engine computes log p_ref (adapter off) for the pass, and
    this loss makes them the context's log-probs, which the pass returns per datum."""

    def needs_reference(self, fields) -> bool:
        return True

    def compute(self, ctx: LossContext):
        ctx.logps_B_T = ctx.ref_logps()  # in place of the policy's (a cached property: computed once, settable)
        return super().compute(ctx)


def is_dpo(loss_fn: str, data: list) -> bool:
    inputs = [d.inputs for d in data]
    return (
        loss_fn == "importance_sampling"
        and bool(inputs)
        and all("ref_logps" in i for i in inputs)
        and not any("logprobs" in i or "advantages" in i for i in inputs)
    )


def loss_for(loss_fn: str, config: dict, data: list, forward_only: bool) -> Loss | None:
    """The loss of a request that uses twinkle-kit's conventions (its datums then check as
    cross-entropy's); None for any other request."""
    if config.get("disable_lora"):
        if loss_fn != "cross_entropy" or not forward_only:
            raise UserError(
                f"disable_lora (the base model's log-probs) is served on forward with 'cross_entropy', "
                f"not on {'forward' if forward_only else 'forward_backward'} with {loss_fn!r}"
            )
        _refuse_other_keys(config, {"disable_lora"}, "the base-model forward")
        return BaseModelCrossEntropy(reduction="sum")
    if not is_dpo(loss_fn, data):
        return None
    _refuse_other_keys(config, set(DPO_CONFIG), "DPO (importance_sampling with ref_logps)")
    if len(data) % 2:
        raise UserError(f"DPO needs (chosen, rejected) datums in consecutive pairs; got {len(data)} datums")
    try:
        return DPOLoss(
            beta=float(config.get("dpo_beta", 0.1)),
            loss_type=str(config.get("dpo_loss_type", "sigmoid")),
            reduction="sum",
            sft_weight=float(config.get("dpo_sft_weight", 0.0)),
        )
    except ValueError as e:
        raise UserError(f"bad loss_fn_config for DPO: {e}") from None


def rows_for(loss: Loss, rows: list[dict]) -> list[dict]:
    """The shifted rows as `loss` reads them: for DPO the reference as `ref_logprobs` and the prompt
    (weight 0) out of the loss; the base-model forward's as they are (cross-entropy reads `weights`)."""
    if not isinstance(loss, DPOLoss):
        return rows
    for row in rows:
        row["ref_logprobs"] = row.pop("ref_logps")
        weights = row.pop("weights", None)
        if weights is not None:
            row["labels"][weights == 0] = IGNORE_INDEX
    return rows


def _refuse_other_keys(config: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(config) - known)
    if unknown:
        raise UserError(f"loss_fn_config keys {unknown} are not honoured by {what}; known: {sorted(known)}")
