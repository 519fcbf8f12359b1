"""An uploaded custom loss as an engine `Loss`: it runs inside the (fused) pass like any built-in loss.

The SDK's client-side fallback takes two passes: a forward for the target log-probs, the loss and its
gradient `g = dLoss/dlogprobs` on the client, then a cross-entropy backward with weights `-g` (whose
gradient is exactly `dLoss/dθ`). Here both halves happen in one pass: the engine's head gives the
log-probs with their graph, the program runs on a detached copy for `g`, and the pass back-propagates
the same weighted cross-entropy the fallback's second request would, `Σ -(-g) · logp` over the
datum's targets. Same ops on the same values, so a tenant alone in a pass gets the fallback's numbers
exactly; fused with others, as close as any fused pass is to a solo one.

The reported loss is the program's (`loss:sum`); the weighted cross-entropy is `surrogate_loss:sum`,
as the SDK names it.
"""

from __future__ import annotations

import torch

from twinkle.loss.base import Loss, LossContext, LossOutput
from twinkle.serve.tinker.custom_loss import LossProgram, run_per_datum

PROGRAM_LOSS = "custom_loss:sum"  # the program's own value, beside the surrogate the pass trains on


class ProgramLoss(Loss):
    """`program` over each datum's target log-probs and its own inputs (`inputs[i]`, tensors of the
    ranks the program declared), rows in datum order. `widths[i]`: K of datum i's [T, K] targets (the
    pass scores the request's widest K), None for [T] targets."""

    def __init__(self, program: LossProgram, inputs: list[list[torch.Tensor]], widths: list[int | None]):
        super().__init__(reduction="sum")
        self.program, self.inputs, self.widths = program, inputs, widths

    def sliced(self, start: int, stop: int) -> ProgramLoss:
        """The loss of datums [start, stop): a data-parallel rank's share of the request."""
        return ProgramLoss(self.program, self.inputs[start:stop], self.widths[start:stop])

    def metric_merge(self, key: str) -> str:
        """The SDK reduces a custom loss's metrics over datums: `…:sum` adds up, the rest are datum means."""
        return "sum" if key.endswith(":sum") else "row_mean"

    def compute(self, ctx: LossContext) -> LossOutput:
        logps, mask_B_T = ctx.scored_logps(), ctx.mask_B_T  # logps [B, T] or [B, T, K]
        lengths = [int(n) for n in mask_B_T.sum(1).tolist()]  # Tinker targets are never -100: a prefix per row
        if len(lengths) != len(self.inputs):
            raise ValueError(f"loss {self.program.name!r} got {len(lengths)} rows for {len(self.inputs)} datums")
        cells = [(slice(None, n), slice(None, k)) if k else (slice(None, n),) for n, k in zip(lengths, self.widths)]
        with torch.enable_grad():  # also under a forward-only pass's no_grad: g is needed for nothing but metrics
            leaves = [logps[i][cell].detach().clone().requires_grad_(True) for i, cell in enumerate(cells)]
            device = logps.device
            inputs = [[t.to(device) for t in row] for row in self.inputs]
            loss, metrics = run_per_datum(self.program, leaves, inputs)
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        weights = torch.zeros_like(logps, requires_grad=False)
        for i, (cell, g) in enumerate(zip(cells, grads, strict=True)):
            if g is None:
                raise ValueError(
                    f"loss {self.program.name!r} does not depend on the logprobs of datum {i}: no gradient"
                )
            weights[i][cell] = -g
        # cross-entropy's per-token value and reduction (twinkle.loss.sft), so the fallback's second pass agrees
        per_token = -weights * logps
        surrogate = ((per_token.sum(-1) if per_token.dim() == 3 else per_token) * mask_B_T).sum()
        return LossOutput(surrogate, {**metrics, PROGRAM_LOSS: float(loss.detach())})


def tinker_metrics(metrics: dict[str, float], forward_only: bool) -> dict[str, float]:
    """The pass's metrics as the SDK reports a custom loss: the program's value is `loss:sum`, the
    weighted cross-entropy a backward trained on is `surrogate_loss:sum` (absent for a forward)."""
    out = dict(metrics)
    surrogate = out.pop("loss:sum", None)
    out["loss:sum"] = out.pop(PROGRAM_LOSS)
    if not forward_only and surrogate is not None:
        out["surrogate_loss:sum"] = surrogate
    return out
