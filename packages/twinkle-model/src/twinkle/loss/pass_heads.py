"""Heads of passes that compute no next-token distribution: a value model's per-token values and an
embedding pass's pooled sequence embeddings. A loss reads them through `TokenHead.values()` /
`TokenHead.embeddings()`; what a token loss would ask of them (log-probs, entropy) is refused by name.

Neither holds vocabulary-sized logits: the value head's output is one number a position, and the
embedding pass runs the model with its output projection skipped (`twinkle.model.output_projection`).
"""

from __future__ import annotations

from typing import Never

import torch
import torch.nn.functional as F

from twinkle.loss.head import TokenHead


class _NoTokens(TokenHead):
    what = ""

    def _refuse(self) -> Never:
        raise ValueError(f"{self.what} has no next-token distribution: a token loss cannot train on it")

    def target_logps(self, targets_B_T: torch.Tensor) -> Never:  # noqa: ARG002 - TokenHead's signature
        self._refuse()

    def entropy(self) -> Never:
        self._refuse()

    def logps_at(self, index_B_T_K: torch.Tensor) -> Never:  # noqa: ARG002 - TokenHead's signature
        self._refuse()

    def argmax(self) -> Never:
        self._refuse()

    def correct(self, targets_B_T: torch.Tensor) -> torch.Tensor:
        """No token is predicted, so none is right: token accuracy counts nothing here."""
        return torch.zeros_like(targets_B_T, dtype=torch.bool)


class ValueHead(_NoTokens):
    """A value model's output: V(prefix up to t) at position t, aligned with the targets (the value of
    the state before target t is emitted)."""

    what = "a value model"

    def __init__(self, values_B_T: torch.Tensor) -> None:
        self.values_B_T = values_B_T

    def values(self) -> torch.Tensor:
        return self.values_B_T


class EmbeddingHead(_NoTokens):
    """One embedding per input sequence: the final hidden state (after the model's last norm) of its
    last real token, L2-normalised, in fp32."""

    what = "an embedding pass"

    def __init__(self, embeddings_N_H: torch.Tensor) -> None:
        self.embeddings_N_H = embeddings_N_H

    @classmethod
    def pooled(cls, hidden_B_T_H: torch.Tensor, spans: list[tuple[int, int, int]]) -> EmbeddingHead:
        """From the pass's hidden states and its sequences' (row, start, length) spans (padded rows:
        one each; packed rows: several)."""
        rows = torch.tensor([b for b, _, _ in spans], device=hidden_B_T_H.device)
        last = torch.tensor([s + n - 1 for _, s, n in spans], device=hidden_B_T_H.device)
        return cls(F.normalize(hidden_B_T_H[rows, last].float(), dim=-1))

    def embeddings(self) -> torch.Tensor:
        return self.embeddings_N_H
