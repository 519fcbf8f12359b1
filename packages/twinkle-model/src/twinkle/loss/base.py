"""The Loss extension point: a base class, the context a loss reads, and the name registry.

Conventions every loss follows:
- token-level: a loss is a function of per-position quantities (log-probs, advantages, ...) over
  the positions whose target is not -100 (`mask_B_T`);
- `reduction='mean'` divides the summed per-token loss by the batch's loss units, `reduction='sum'`
  does not (Tinker's losses are sums). A loss class declares its `unit`: loss tokens (the default),
  (chosen, rejected) pairs for the preference losses, or sequences; `Loss.units` counts them from the
  targets and inputs alone, so an engine knows a data-parallel step's global units before the forward;
- per-token input fields arrive shifted like the targets (position t belongs to target t); a
  per-row field (shape [B]) is broadcast over that row's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss.head import HeadNeeds, LogitsHead, TokenHead
from twinkle.registry import Registry


@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LossContext:
    head: TokenHead
    targets_B_T: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)
    # log p_ref(target) from the reference policy (for a LoRA: the same base with the adapter disabled)
    ref_logps_B_T: torch.Tensor | None = None
    # the collated inputs this context was built from (an engine reads row lengths from it)
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    # under context parallelism, the sequence shard these rows are (model.context_parallel.Shard)
    shard: Any = None

    @classmethod
    def from_logits(
        cls,
        logits_B_T_V: torch.Tensor,
        targets_B_T: torch.Tensor,
        ref_logps_B_T: torch.Tensor | None = None,
        **fields: torch.Tensor,
    ) -> LossContext:
        """A context over already-shifted logits (position t predicts targets_B_T[:, t])."""
        return cls(LogitsHead(logits_B_T_V), targets_B_T, dict(fields), ref_logps_B_T)

    # Computed once, cached by hand: functools.cached_property (before Python 3.12) holds one lock for
    # every instance while it computes, and a served pass may pause inside (twinkle.model.preemption:
    # the chunked head's points) while another pass reads its own context — a deadlock.
    @property
    def mask_B_T(self) -> torch.Tensor:
        if "_mask_B_T" not in self.__dict__:
            self.__dict__["_mask_B_T"] = (self.targets_B_T != IGNORE_INDEX).float()
        return self.__dict__["_mask_B_T"]

    @property
    def logps_B_T(self) -> torch.Tensor:
        if "_logps_B_T" not in self.__dict__:
            self.__dict__["_logps_B_T"] = self.head.target_logps(self.targets_B_T)
        return self.__dict__["_logps_B_T"]

    @logps_B_T.setter
    def logps_B_T(self, value: torch.Tensor) -> None:  # a loss scoring other log-probs (kit_dpo's reference)
        self.__dict__["_logps_B_T"] = value

    def has(self, name: str) -> bool:
        return name in self.fields

    def scored_logps(self) -> torch.Tensor:
        """What a pass reports per position: log p(target) [B, T], or with a `target_ids` input [B, T, K]
        (K ids scored at each position) log p of each of those ids, [B, T, K]."""
        ids_B_T_K = self.fields.get("target_ids")
        return self.logps_B_T if ids_B_T_K is None else self.head.logps_at(ids_B_T_K)

    def token_field(self, name: str, default: float | None = None) -> torch.Tensor:
        """A per-token float field [B, T]; per-row fields broadcast; `default` fills a missing one."""
        return token_field(self.fields, name, self.mask_B_T, default)

    def ref_logps(self) -> torch.Tensor:
        """Reference log-probs: the `ref_logprobs` input if given, else those the model computed."""
        if "ref_logprobs" in self.fields:
            return self.token_field("ref_logprobs")
        if self.ref_logps_B_T is None:
            raise ValueError(
                "this loss needs reference log-probs: pass `ref_logprobs` per token, or train a "
                "LoRA adapter so the reference is the base model with the adapter disabled"
            )
        return self.ref_logps_B_T


class Loss:
    """Base class. Subclasses implement `per_token` (token-level) or override `compute`."""

    aliases: ClassVar[tuple[str, ...]] = ()
    required_fields: ClassVar[tuple[str, ...]] = ()
    unit: ClassVar[Literal["token", "pair", "sequence"]] = "token"  # what a 'mean' reduction averages over

    def __init__(self, reduction: str = "mean") -> None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.reduction = reduction

    def needs_reference(self, fields: dict) -> bool:
        """Whether the model must compute reference log-probs (adapter disabled) for this batch."""
        return False

    def head_needs(self, ctx: LossContext) -> HeadNeeds:
        """What this loss asks of the head beyond target log-probs (entropy, log-probs at given ids):
        a chunked head computes them in the same sweep over the vocabulary. By default: the ids of a
        `target_ids` input, whose log-probs the pass reports (`LossContext.scored_logps`)."""
        return HeadNeeds(index_B_T_K=ctx.fields.get("target_ids"))

    def units(self, targets_B_T: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> float:
        """This batch's loss units (`unit`), from its shifted targets and loss inputs: what a 'mean'
        reduction divides by, and so what a data-parallel rank's share of the batch is counted in."""
        if self.unit == "pair":
            return float(targets_B_T.shape[0] // 2)
        scored_B_T = targets_B_T != IGNORE_INDEX
        return float((scored_B_T.any(dim=1) if self.unit == "sequence" else scored_B_T).sum())

    def metric_merge(self, key: str) -> str:
        """How this loss's metric `key` combines over slices of one batch's rows (data ranks): 'sum',
        'row_mean' or 'unit_mean' (the built-ins' metrics are means over the loss's units)."""
        return "unit_mean"

    def sliced(self, start: int, stop: int) -> Loss:
        """This loss for rows [start, stop) of its batch (a data rank's share): the same loss, unless it
        holds per-row inputs of its own (a Tinker custom loss does)."""
        return self

    def __call__(self, ctx: LossContext) -> LossOutput:
        missing = [f for f in self.required_fields if f not in ctx.fields]
        if missing:
            raise ValueError(f"{type(self).__name__} needs input fields {missing}; got {sorted(ctx.fields)}")
        ctx.head.request(self.head_needs(ctx), ctx.targets_B_T)
        out = self.compute(ctx)
        return out if isinstance(out, LossOutput) else LossOutput(out)

    def compute(self, ctx: LossContext) -> torch.Tensor | LossOutput:
        return self.reduce(self.per_token(ctx), ctx.mask_B_T)

    def per_token(self, ctx: LossContext) -> torch.Tensor:
        raise NotImplementedError

    def reduce(self, values_B_T: torch.Tensor, mask_B_T: torch.Tensor) -> torch.Tensor:
        total = (values_B_T * mask_B_T).sum()
        return total if self.reduction == "sum" else total / mask_B_T.sum().clamp(min=1.0)


def token_field(
    fields: Mapping[str, torch.Tensor], name: str, mask_B_T: torch.Tensor, default: float | None = None
) -> torch.Tensor:
    """The loss input `name` per token, shaped like `mask_B_T` (a per-row input is broadcast over its
    row); `default` fills a missing one."""
    if name not in fields:
        if default is None:
            raise KeyError(name)
        return torch.full_like(mask_B_T, default)
    value = fields[name].to(mask_B_T.device, torch.float32)
    if value.dim() == 1:
        value = value[:, None].expand_as(mask_B_T)
    if value.shape != mask_B_T.shape:
        raise ValueError(
            f"loss input {name!r} has shape {tuple(value.shape)}; expected "
            f"{tuple(mask_B_T.shape)} (per token) or ({mask_B_T.shape[0]},) (per row)"
        )
    return value


LOSSES: Registry[Loss] = Registry("loss", "twinkle.loss", Loss)
register_loss = LOSSES.register


def create_loss(name_or_cls: str | type[Loss] | Loss, **kwargs: Any) -> Loss:
    return LOSSES.create(name_or_cls, **kwargs)
