"""Per-position next-token distributions, as losses see them.

A loss never indexes raw logits itself; it asks a head for what it needs (the target token's
log-prob, the entropy, log-probs at given ids, the argmax for token accuracy). `LogitsHead` wraps
materialised logits; `ChunkedHead` holds hidden states plus the output projection and computes
everything a loss asked for in one sweep over the vocabulary a chunk of positions at a time
(`twinkle.loss.chunked_logps`), so full-vocabulary logits never exist. Engines pick it by
default when a pass's logits would exceed `LOGITS_BUDGET_BYTES`.
All tensors here are already shifted: position t predicts `targets_B_T[:, t]`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.loss.chunked_logps import chunked_logps

# Logits beyond this size are never materialised (~55 tokens of Qwen3's 151,936-token vocabulary in
# fp32, ~9.9K of the embedded models' 850): engines compute the head in chunks instead
LOGITS_BUDGET_BYTES = 32 << 20
# fp32 logits of one chunk: 441 positions of a 151,936-token vocabulary; the whole batch for small ones
CHUNK_BYTES = 256 << 20


def chunk_positions(vocab_size: int) -> int:
    return max(64, CHUNK_BYTES // (4 * vocab_size))


def _target_logps(logits_V: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Over [..., V] logits as they are: a strided view (the `[:, :-1]` slice) is never copied by a reshape."""
    logits_V = logits_V.float()
    picked = logits_V.gather(-1, targets.clamp(min=0)[..., None]).squeeze(-1)
    logps = picked - torch.logsumexp(logits_V, dim=-1)
    return logps.masked_fill(targets == IGNORE_INDEX, 0.0)


def _entropy(logits_N_V: torch.Tensor) -> torch.Tensor:
    logp_N_V = F.log_softmax(logits_N_V.float(), dim=-1)
    return -(logp_N_V.exp() * logp_N_V).sum(-1)


def _logps_at(logits_N_V: torch.Tensor, index_N_K: torch.Tensor) -> torch.Tensor:
    logits_N_V = logits_N_V.float()
    return logits_N_V.gather(-1, index_N_K.long()) - torch.logsumexp(logits_N_V, dim=-1, keepdim=True)


@dataclass(frozen=True)
class HeadNeeds:
    """What a loss will ask of a head beyond the target log-probs, said before it asks, so a chunked
    head computes all of it in one sweep (`Loss.head_needs`)."""

    entropy: bool = False
    index_B_T_K: torch.Tensor | None = None


class TokenHead:
    """Base: the model's next-token distribution at every (row, position)."""

    def request(self, needs: HeadNeeds, targets_B_T: torch.Tensor | None = None) -> None:
        """A hint: what the coming calls will ask for, and the targets whose log-probs they will ask
        for (a chunked head computes all of it in one sweep)."""

    def target_logps(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        """log p(target) per position; 0 where the target is IGNORE_INDEX."""
        raise NotImplementedError

    def entropy(self) -> torch.Tensor:
        raise NotImplementedError

    def logps_at(self, index_B_T_K: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def argmax(self) -> torch.Tensor:
        raise NotImplementedError

    def correct(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        """Whether the most likely token is the target, per position (token accuracy)."""
        return self.argmax() == targets_B_T

    # What a pass without a next-token distribution gives instead (twinkle.loss.pass_heads); a token
    # head has neither, and says which pass does.
    def values(self) -> torch.Tensor:
        """A value head's estimate per position [B, T], aligned with the targets."""
        raise ValueError(
            "this loss reads per-token values, which only a model with a value head gives: "
            "train it on twinkle.model.TransformersValueModel"
        )

    def embeddings(self) -> torch.Tensor:
        """One L2-normalised embedding per input sequence [N, H], in row order."""
        raise ValueError("this loss reads pooled sequence embeddings: call forward_backward(..., task='embedding')")


class LogitsHead(TokenHead):
    def __init__(self, logits_B_T_V: torch.Tensor) -> None:
        self.logits_B_T_V = logits_B_T_V

    def target_logps(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        return _target_logps(self.logits_B_T_V, targets_B_T)

    def entropy(self) -> torch.Tensor:
        return _entropy(self.logits_B_T_V)

    def logps_at(self, index_B_T_K: torch.Tensor) -> torch.Tensor:
        return _logps_at(self.logits_B_T_V, index_B_T_K)

    def argmax(self) -> torch.Tensor:
        return self.logits_B_T_V.argmax(-1)


class ChunkedHead(TokenHead):
    """Logits = logit_scale · (hidden @ weight.T + bias), never materialised: every quantity comes from
    `chunked_logps`, `chunk_size` positions at a time (default: `chunk_positions(vocab)`), and what a
    loss declared through `request` comes from the same sweep as the target log-probs."""

    def __init__(
        self,
        hidden_B_T_H: torch.Tensor,
        weight_V_H: torch.Tensor,
        bias_V: torch.Tensor | None = None,
        chunk_size: int | None = None,
        logit_scale: float = 1.0,
    ) -> None:
        self.hidden_B_T_H, self.weight_V_H, self.bias_V = hidden_B_T_H, weight_V_H, bias_V
        self.chunk_size = chunk_size or chunk_positions(weight_V_H.shape[0])
        self.logit_scale = logit_scale
        self.needs, self._targets = HeadNeeds(), None
        self._swept: dict = {}  # the main sweep's inputs and outputs, which every call reads first

    def request(self, needs: HeadNeeds, targets_B_T: torch.Tensor | None = None) -> None:
        self.needs, self._targets = needs, targets_B_T

    def _main(self, targets_B_T: torch.Tensor | None) -> dict:
        if not self._swept or self._swept["targets"] is not targets_B_T:
            self._swept = self._sweep(targets_B_T, self.needs.entropy, self.needs.index_B_T_K)
        return self._swept

    def _sweep(self, targets_B_T: torch.Tensor | None, entropy: bool, index_B_T_K: torch.Tensor | None) -> dict:
        B, T, H = self.hidden_B_T_H.shape
        given = targets_B_T
        if targets_B_T is None:
            targets_B_T = torch.full((B, T), IGNORE_INDEX, dtype=torch.long, device=self.hidden_B_T_H.device)
        index_N_K = index_B_T_K.reshape(B * T, -1).long() if index_B_T_K is not None else None
        logps, ent, at, argmax = chunked_logps(
            self.hidden_B_T_H.reshape(B * T, H),
            self.weight_V_H,
            self.bias_V,
            targets_B_T.reshape(-1),
            index_N_K=index_N_K,
            entropy=entropy,
            chunk=self.chunk_size,
            scale=self.logit_scale,
        )
        return {
            "targets": given,
            "logps": logps.view(B, T),
            "entropy": ent.view(B, T) if entropy else None,
            "index": index_B_T_K,
            "at": at.view(B, T, -1) if index_N_K is not None else None,
            "argmax": argmax.view(B, T),
        }

    def target_logps(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        return self._main(targets_B_T)["logps"]

    def entropy(self) -> torch.Tensor:
        swept = self._swept or self._main(self._targets)
        if swept["entropy"] is None:  # not requested: a sweep of its own
            return self._sweep(None, True, None)["entropy"]
        return swept["entropy"]

    def logps_at(self, index_B_T_K: torch.Tensor) -> torch.Tensor:
        swept = self._swept or self._main(self._targets)
        if swept["index"] is not index_B_T_K:
            return self._sweep(None, False, index_B_T_K)["at"]
        return swept["at"]

    def argmax(self) -> torch.Tensor:
        if not self._swept:  # nothing asked yet: a sweep without gradient, not kept
            with torch.no_grad():
                return self._sweep(None, False, None)["argmax"]
        return self._swept["argmax"]


class _MappedHead(TokenHead):
    """A head whose quantities come from `_map(fn, *per_position)`: fn applied to logits a chunk at a time."""

    def _map(self, fn: Callable[..., torch.Tensor], *per_position: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target_logps(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        return self._map(_target_logps, targets_B_T)

    def entropy(self) -> torch.Tensor:
        return self._map(_entropy)

    def logps_at(self, index_B_T_K: torch.Tensor) -> torch.Tensor:
        return self._map(_logps_at, index_B_T_K)

    def argmax(self) -> torch.Tensor:
        with torch.no_grad():
            return self._map(lambda logits: logits.argmax(-1))


class ProjectedHead(_MappedHead):
    """Logits = project(hidden[:, t0:t1]) over time chunks of about `chunk_tokens` tokens (all rows
    of a chunk together), each chunk's logits recomputed in backward. `project` may be any module
    (a LoRA-wrapped unembedding routed by batch rows included): unlike `ChunkedHead` it keeps the
    batch dimension, so row-routed layers see the rows they were routed for."""

    def __init__(
        self, hidden_B_T_H: torch.Tensor, project: Callable[[torch.Tensor], torch.Tensor], chunk_tokens: int = 4096
    ) -> None:
        self.hidden_B_T_H, self.project = hidden_B_T_H, project
        self.step = max(1, chunk_tokens // max(1, hidden_B_T_H.shape[0]))

    def _map(self, fn: Callable[..., torch.Tensor], *per_position: torch.Tensor) -> torch.Tensor:
        B, T, _ = self.hidden_B_T_H.shape

        def chunk(h_B_t_H: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
            logits_B_t_V = self.project(h_B_t_H)
            t = h_B_t_H.shape[1]
            out = fn(logits_B_t_V.reshape(B * t, -1), *(a.reshape(B * t, *a.shape[2:]) for a in args))
            return out.view(B, t, *out.shape[1:])

        from twinkle.model import preemption  # a served long row may pause between chunks, both ways

        outs = []
        for t0 in range(0, T, self.step):
            sl = slice(t0, t0 + self.step)
            args = (self.hidden_B_T_H[:, sl], *(x[:, sl] for x in per_position))
            if torch.is_grad_enabled():
                outs.append(checkpoint(chunk, *args, use_reentrant=False))
                preemption.pause_before_backward_of(outs[-1])
            else:
                outs.append(chunk(*args))
            preemption.point()
        return torch.cat(outs, dim=1)
