"""Token log-probs straight from hidden states, a chunk of positions at a time, never `[N, V]` logits.

`chunked_logps` computes, for every position n with logits z_n = scale · (W h_n + b):
    log p(t_n)           the target's log-prob (0 where t_n is IGNORE_INDEX)
    H_n                  the entropy (on request)
    log p(k) for k ∈ K_n  log-probs at given ids (on request: a teacher's top-k)
    argmax_n             the most likely id (token accuracy, at no extra pass: it comes with the max
                         that the log-sum-exp needs anyway)
in one sweep over the vocabulary per chunk. Every gradient is a linear function of the incoming
per-position gradients, so with a frozen head (LoRA, whose head is the frozen base's) the forward
also stores what backward needs, two `[N, H]` products per chunk: pW_n = Σ_v p_nv W_v and, for the
entropy, qW_n = Σ_v p_nv log p_nv W_v. Then
    ∂ log p(t_n) / ∂h_n = scale · (W_{t_n} − pW_n)
    ∂ H_n / ∂h_n        = −scale · (qW_n + H_n · pW_n)
    ∂ log p(k) / ∂h_n   = scale · (W_k − pW_n)
and backward is a few `[N, H]` operations: the same two vocabulary-wide matmuls per chunk as
unchunked logits with autograd, none more. A head that trains (full fine-tuning) needs Σ_n g_n p_n h_nᵀ,
which depends on the incoming g: its backward recomputes each chunk's logits (one matmul more).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from twinkle.data_format.labels import IGNORE_INDEX

Grads = tuple[torch.Tensor | None, ...]  # one per input of ChunkedLogps.forward
# torch's autograd ctx: saved_tensors, needs_input_grad, and the attributes forward sets on it
Ctx = Any


def _logits(
    hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor, bias_V: torch.Tensor | None, scale: float
) -> torch.Tensor:
    logits_N_V = F.linear(hidden_N_H, weight_V_H, bias_V).float()
    return logits_N_V.mul_(scale) if scale != 1.0 else logits_N_V


class _Chunk:
    """One chunk's softmax statistics, computed in place over its fp32 logits."""

    def __init__(
        self, logits_N_V: torch.Tensor, targets_N: torch.Tensor, index_N_K: torch.Tensor | None, want_entropy: bool
    ) -> None:
        safe_N = targets_N.clamp(min=0)
        self.target_logit_N = logits_N_V.gather(-1, safe_N[:, None]).squeeze(-1)
        self.index_logit_N_K = logits_N_V.gather(-1, index_N_K) if index_N_K is not None else None
        max_N, self.argmax_N = logits_N_V.max(-1)
        shifted_N_V = logits_N_V.sub_(max_N[:, None])  # z − max, in place
        exp_N_V = shifted_N_V.exp() if want_entropy else shifted_N_V.exp_()
        sum_N = exp_N_V.sum(-1)
        self.lse_N = max_N + sum_N.log()
        self.probs_N_V = exp_N_V.div_(sum_N[:, None])
        self.entropy_N = logits_N_V.new_empty(0)  # filled only when the entropy is wanted
        if want_entropy:  # H = lse − Σ p z = log Σ − Σ p (z − max)
            self.entropy_N = sum_N.log() - torch.linalg.vecdot(self.probs_N_V, shifted_N_V)
            self.log_probs_N_V = shifted_N_V.sub_(sum_N.log()[:, None])  # log p, in place

    def target_logps(self, targets_N: torch.Tensor) -> torch.Tensor:
        logps_N = self.target_logit_N - self.lse_N
        return logps_N.masked_fill(targets_N == IGNORE_INDEX, 0.0)


class ChunkedLogps(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Ctx,
        hidden_N_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None,
        targets_N: torch.Tensor,
        index_N_K: torch.Tensor | None,
        want_entropy: bool,
        chunk: int,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        from twinkle.model.preemption import point  # a served long row may pause between chunks

        N = hidden_N_H.shape[0]
        trains_head = weight_V_H.requires_grad or (bias_V is not None and bias_V.requires_grad)
        keep_products = hidden_N_H.requires_grad and not trains_head
        f32, dev, H = torch.float32, hidden_N_H.device, hidden_N_H.shape[1]
        logps_N, argmax_N = torch.empty(N, dtype=f32, device=dev), torch.empty(N, dtype=torch.long, device=dev)
        entropy_N = torch.empty(N if want_entropy else 0, dtype=f32, device=dev)
        at_N_K = torch.empty((N, index_N_K.shape[1]) if index_N_K is not None else (0, 0), dtype=f32, device=dev)
        pw_N_H = torch.empty(N if keep_products else 0, H, dtype=f32, device=dev)
        qw_N_H = torch.empty(N if keep_products and want_entropy else 0, H, dtype=f32, device=dev)
        for s in range(0, N, chunk):
            sl = slice(s, s + chunk)
            index = index_N_K[sl] if index_N_K is not None else None
            c = _Chunk(_logits(hidden_N_H[sl], weight_V_H, bias_V, scale), targets_N[sl], index, want_entropy)
            logps_N[sl], argmax_N[sl] = c.target_logps(targets_N[sl]), c.argmax_N
            if want_entropy:
                entropy_N[sl] = c.entropy_N
            if c.index_logit_N_K is not None:  # an index was given
                at_N_K[sl] = c.index_logit_N_K - c.lse_N[:, None]
            if keep_products:  # in the weight's dtype, as autograd would multiply the logits' gradient
                pw_N_H[sl] = c.probs_N_V.to(weight_V_H.dtype) @ weight_V_H
                if want_entropy:
                    qw_N_H[sl] = c.log_probs_N_V.mul_(c.probs_N_V).to(weight_V_H.dtype) @ weight_V_H
            del c
            point()
        ctx.mark_non_differentiable(argmax_N)
        ctx.want_entropy, ctx.chunk, ctx.scale, ctx.keep_products = want_entropy, chunk, scale, keep_products
        saved = (hidden_N_H, weight_V_H, bias_V, targets_N, index_N_K)
        if keep_products:
            ctx.save_for_backward(*saved, entropy_N, pw_N_H, qw_N_H)
        else:
            ctx.save_for_backward(*saved)
        return logps_N, entropy_N, at_N_K, argmax_N

    @staticmethod
    def backward(ctx: Ctx, *grads: torch.Tensor) -> Grads:
        g_logps_N, g_entropy_N, g_at_N_K, _ = grads  # one per output; argmax has none that matters
        if ctx.keep_products:
            hidden, weight, _, targets, index, entropy, pw, qw = ctx.saved_tensors
            grad_h = _hidden_grad(
                ctx, hidden, weight, targets, index, entropy, pw, qw, g_logps_N, g_entropy_N, g_at_N_K
            )
            return grad_h, None, None, None, None, None, None, None
        return _recompute_backward(ctx, g_logps_N, g_entropy_N, g_at_N_K)


def _hidden_grad(
    ctx: Ctx,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    index: torch.Tensor | None,
    entropy: torch.Tensor,
    pw: torch.Tensor,
    qw: torch.Tensor,
    g_logps: torch.Tensor,
    g_entropy: torch.Tensor,
    g_at: torch.Tensor,
) -> torch.Tensor:
    """The frozen-head backward: per position a sum of stored [H] vectors and gathered head rows."""
    from twinkle.model.preemption import point

    grad_N_H = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
    g_logps = g_logps.masked_fill(targets == IGNORE_INDEX, 0.0)
    for s in range(0, hidden.shape[0], ctx.chunk):
        sl = slice(s, s + ctx.chunk)
        # Σ over what was asked of position n: coefficient of W rows, and of pW
        rows = weight[targets[sl].clamp(min=0)].float().mul_(g_logps[sl, None])
        coef_pw = g_logps[sl].clone()
        if index is not None:  # an index was given
            rows.add_(torch.bmm(g_at[sl, None, :], weight[index[sl]].float()).squeeze(1))
            coef_pw.add_(g_at[sl].sum(-1))
        g = rows.sub_(pw[sl] * coef_pw[:, None])
        if ctx.want_entropy:
            g.sub_((qw[sl] + entropy[sl, None] * pw[sl]) * g_entropy[sl, None])
        grad_N_H[sl] = g.mul_(ctx.scale) if ctx.scale != 1.0 else g
        point()
    return grad_N_H


def _recompute_backward(ctx: Ctx, g_logps: torch.Tensor, g_entropy: torch.Tensor, g_at: torch.Tensor) -> Grads:
    """A trained head: each chunk's logits again, their gradient, then the input, weight and bias grads."""
    from twinkle.model.preemption import point

    hidden, weight, bias, targets, index = ctx.saved_tensors
    needs_h, needs_w, needs_b = ctx.needs_input_grad[:3]
    grad_h = torch.empty_like(hidden) if needs_h else None
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs_w else None
    grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs_b else None
    g_logps = g_logps.masked_fill(targets == IGNORE_INDEX, 0.0)
    for s in range(0, hidden.shape[0], ctx.chunk):
        sl = slice(s, s + ctx.chunk)
        idx = index[sl] if index is not None else None
        c = _Chunk(_logits(hidden[sl], weight, bias, ctx.scale), targets[sl], idx, ctx.want_entropy)
        # ∂/∂z of Σ g·log p(t) + Σ g_at·log p(k) + Σ g_e·H, with p = softmax(z)
        coef_N = g_logps[sl] + (g_at[sl].sum(-1) if idx is not None and g_at is not None else 0.0)
        if ctx.want_entropy:  # ∂H/∂z = −p (log p + H)
            dz_N_V = c.log_probs_N_V.add_(c.entropy_N[:, None]).mul_(-g_entropy[sl, None])
            dz_N_V.sub_(coef_N[:, None]).mul_(c.probs_N_V)
        else:
            dz_N_V = c.probs_N_V.mul_(-coef_N[:, None])
        dz_N_V.scatter_add_(-1, targets[sl].clamp(min=0)[:, None], g_logps[sl, None])
        if idx is not None:
            dz_N_V.scatter_add_(-1, idx, g_at[sl])
        if ctx.scale != 1.0:
            dz_N_V.mul_(ctx.scale)
        if grad_h is not None:
            grad_h[sl] = dz_N_V.to(weight.dtype) @ weight
        if grad_w is not None:
            grad_w.addmm_(dz_N_V.t(), hidden[sl].float())
        if grad_b is not None:
            grad_b.add_(dz_N_V.sum(0))
        del c, dz_N_V
        point()
    grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
    grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
    return grad_h, grad_w, grad_b, None, None, None, None, None


def chunked_logps(
    hidden_N_H: torch.Tensor,
    weight_V_H: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    *,
    index_N_K: torch.Tensor | None = None,
    entropy: bool = False,
    chunk: int = 1024,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target log-probs [N], entropy [N] or empty, log-probs at index [N, K] or empty, argmax [N])."""
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    return ChunkedLogps.apply(hidden_N_H, weight_V_H, bias_V, targets_N, index_N_K, entropy, chunk, scale)
