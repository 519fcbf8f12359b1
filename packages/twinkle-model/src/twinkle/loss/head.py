"""Per-position next-token distributions, as losses see them.

A loss never indexes raw logits itself; it asks a head for what it needs (the target token's
log-prob, the entropy, log-probs at given ids). `LogitsHead` wraps materialised logits;
`ChunkedHead` holds hidden states plus the output projection and computes the same quantities a
chunk of positions at a time, recomputing each chunk's logits in backward, so full-vocabulary
logits for the whole batch never exist at once (see `twinkle.patch.ChunkedCrossEntropy`).
All tensors here are already shifted: position t predicts `targets_B_T[:, t]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def _target_logps(logits_N_V: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    logits_N_V = logits_N_V.float()
    safe_N = targets_N.clamp(min=0)
    picked_N = logits_N_V.gather(-1, safe_N[:, None]).squeeze(-1)
    logps_N = picked_N - torch.logsumexp(logits_N_V, dim=-1)
    return torch.where(targets_N == IGNORE_INDEX, torch.zeros_like(logps_N), logps_N)


def _entropy(logits_N_V: torch.Tensor) -> torch.Tensor:
    logp_N_V = F.log_softmax(logits_N_V.float(), dim=-1)
    return -(logp_N_V.exp() * logp_N_V).sum(-1)


def _logps_at(logits_N_V: torch.Tensor, index_N_K: torch.Tensor) -> torch.Tensor:
    logits_N_V = logits_N_V.float()
    return logits_N_V.gather(-1, index_N_K) - torch.logsumexp(logits_N_V, dim=-1, keepdim=True)


class TokenHead:
    """Base: the model's next-token distribution at every (row, position)."""

    def target_logps(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        """log p(target) per position; 0 where the target is IGNORE_INDEX."""
        raise NotImplementedError

    def entropy(self) -> torch.Tensor:
        raise NotImplementedError

    def logps_at(self, index_B_T_K: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def argmax(self) -> torch.Tensor:
        raise NotImplementedError


class LogitsHead(TokenHead):
    def __init__(self, logits_B_T_V: torch.Tensor):
        self.logits_B_T_V = logits_B_T_V

    def target_logps(self, targets_B_T):
        B, T, V = self.logits_B_T_V.shape
        return _target_logps(self.logits_B_T_V.reshape(B * T, V), targets_B_T.reshape(-1)).view(B, T)

    def entropy(self):
        return _entropy(self.logits_B_T_V)

    def logps_at(self, index_B_T_K):
        return _logps_at(self.logits_B_T_V, index_B_T_K)

    def argmax(self):
        return self.logits_B_T_V.argmax(-1)


class _MappedHead(TokenHead):
    """A head whose quantities come from `_map(fn, *per_position)`: fn applied to logits a chunk at a time."""

    def _map(self, fn, *per_position: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target_logps(self, targets_B_T):
        return self._map(_target_logps, targets_B_T)

    def entropy(self):
        return self._map(_entropy)

    def logps_at(self, index_B_T_K):
        return self._map(_logps_at, index_B_T_K)

    def argmax(self):
        with torch.no_grad():
            return self._map(lambda logits: logits.argmax(-1))


class ChunkedHead(_MappedHead):
    """Logits = hidden @ weight.T (+ bias), computed `chunk_size` positions at a time."""

    def __init__(
        self,
        hidden_B_T_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None = None,
        chunk_size: int = 1024,
        logit_scale: float = 1.0,
    ):
        self.hidden_B_T_H, self.weight_V_H, self.bias_V = hidden_B_T_H, weight_V_H, bias_V
        self.chunk_size, self.logit_scale = chunk_size, logit_scale

    def _logits(self, hidden_N_H: torch.Tensor, weight_V_H: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_N_H, weight_V_H, self.bias_V)
        return logits * self.logit_scale if self.logit_scale != 1.0 else logits

    def _map(self, fn, *per_position: torch.Tensor) -> torch.Tensor:
        """Apply fn(logits_chunk, *chunk_args) over position chunks; each chunk's logits are recomputed in backward."""
        B, T, H = self.hidden_B_T_H.shape
        hidden_N_H = self.hidden_B_T_H.reshape(B * T, H)
        flat = [x.reshape(B * T, *x.shape[2:]) for x in per_position]
        outs = []
        for start in range(0, B * T, self.chunk_size):
            sl = slice(start, start + self.chunk_size)

            def chunk(h, w, *args):
                return fn(self._logits(h, w), *args)

            outs.append(checkpoint(chunk, hidden_N_H[sl], self.weight_V_H, *(x[sl] for x in flat), use_reentrant=False))
        out = torch.cat(outs)
        return out.view(B, T, *out.shape[1:])


class ProjectedHead(_MappedHead):
    """Logits = project(hidden[:, t0:t1]) over time chunks of about `chunk_tokens` tokens (all rows
    of a chunk together), each chunk's logits recomputed in backward. `project` may be any module
    (a LoRA-wrapped unembedding routed by batch rows included): unlike `ChunkedHead` it keeps the
    batch dimension, so row-routed layers see the rows they were routed for."""

    def __init__(self, hidden_B_T_H: torch.Tensor, project, chunk_tokens: int = 4096):
        self.hidden_B_T_H, self.project = hidden_B_T_H, project
        self.step = max(1, chunk_tokens // max(1, hidden_B_T_H.shape[0]))

    def _map(self, fn, *per_position: torch.Tensor) -> torch.Tensor:
        B, T, _ = self.hidden_B_T_H.shape

        def chunk(h_B_t_H, *args):
            logits_B_t_V = self.project(h_B_t_H)
            t = h_B_t_H.shape[1]
            out = fn(logits_B_t_V.reshape(B * t, -1), *(a.reshape(B * t, *a.shape[2:]) for a in args))
            return out.view(B, t, *out.shape[1:])

        outs = []
        for t0 in range(0, T, self.step):
            sl = slice(t0, t0 + self.step)
            args = (self.hidden_B_T_H[:, sl], *(x[:, sl] for x in per_position))
            if torch.is_grad_enabled():
                outs.append(checkpoint(chunk, *args, use_reentrant=False))
            else:
                outs.append(chunk(*args))
        return torch.cat(outs, dim=1)
