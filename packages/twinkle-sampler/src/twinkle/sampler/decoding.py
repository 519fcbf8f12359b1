"""Token choice and stopping, shared by the torch decode loop: pure functions of logits and state."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from twinkle.sampler.params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, sample index) over distinct streams


def row_seed(seed: int, sample_index: int) -> int:
    """The RNG seed of one sequence: depends on the request seed and sample index only, never on the
    batch it lands in, so the same seed gives the same output however prompts are batched."""
    return (seed * _MIX + sample_index * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def filter_logits(logits_B_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus); removed tokens get -inf."""
    # Shift each row's best logit to 0 first (softmax does not change): a tiny temperature then sends the
    # others to -inf instead of overflowing every logit to inf (a NaN distribution).
    # A temperature below float32's smallest normal (5e-324 arrives from JSON) would become 0 (0/0 = NaN).
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits_B_V = (logits_B_V - logits_B_V.max(dim=-1, keepdim=True).values) / temperature
    if params.top_k and params.top_k < logits_B_V.shape[-1]:
        kth_B_1 = logits_B_V.topk(params.top_k, dim=-1).values[:, -1:]
        logits_B_V = logits_B_V.masked_fill(logits_B_V < kth_B_1, float("-inf"))
    if params.top_p < 1.0:
        sorted_B_V, order_B_V = logits_B_V.sort(dim=-1, descending=True)
        probs_B_V = sorted_B_V.softmax(dim=-1)
        # Drop a token once the mass *before* it already reaches top_p (the top token always stays).
        drop_B_V = (probs_B_V.cumsum(dim=-1) - probs_B_V) >= params.top_p
        drop_B_V[:, 0] = False  # even when top_p rounds to 0 in float32 (5e-324): never an empty nucleus
        drop_B_V = drop_B_V.scatter(-1, order_B_V, drop_B_V)
        logits_B_V = logits_B_V.masked_fill(drop_B_V, float("-inf"))
    return logits_B_V


def choose_tokens(logits_B_V: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax when temperature is 0, else a draw from each row's own generator."""
    if params.temperature == 0:
        return logits_B_V.argmax(dim=-1)
    probs_B_V = filter_logits(logits_B_V.float(), params).softmax(dim=-1)
    # torch.multinomial's own draw for one sample (argmax of p / Exp(1) noise), with the noise drawn per
    # row from the row's generator and the rest batched: the same tokens, bit for bit, as one multinomial
    # call per row, in three whole-batch passes over the vocabulary instead of four per row.
    noise_B_V = exponential_rows(probs_B_V, generators)
    ratio_B_V = probs_B_V.div_(noise_B_V)
    next_B = ratio_B_V.argmax(dim=-1)
    if not ratio_B_V.gather(-1, next_B[:, None]).isfinite().all():  # a NaN anywhere in a row is its argmax
        raise RuntimeError("the model's next-token probabilities contain NaN or inf")
    return next_B


def exponential_rows(like_B_V: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Exp(1) noise shaped like `like_B_V`, row i from generator i: for float32 noise on the CPU, what
    `row.exponential_(generator=g)` draws, ~3x faster. torch's CPU kernel computes -log1p(-u) of a float64
    uniform u per element, serially (~2.8 ms a 151,936-token row, 23 ms of a 0.6B-shaped decode step for 8
    rows; issue 47); `uniform_` draws the same u from the same stream (53 bits of one 64-bit draw in both)
    and the transform runs vectorized. Its log1p may differ from the scalar one in the last bit of the
    float64, which rounding to float32 hides: 0 differences in 18M draws with the AVX-512, AVX2 and default
    kernels (float64 noise would show them: it keeps exponential_, as other devices do)."""
    if like_B_V.device.type != "cpu" or like_B_V.dtype != torch.float32:
        noise_B_V = torch.empty_like(like_B_V)
        for row_V, g in zip(noise_B_V, generators):
            row_V.exponential_(generator=g)
        return noise_B_V
    u_B_V = torch.empty(like_B_V.shape, dtype=torch.float64)
    for row_V, g in zip(u_B_V, generators):
        row_V.uniform_(generator=g)
    return torch.log1p(u_B_V.neg_(), out=u_B_V).neg_().to(like_B_V.dtype)


class StopChecker:
    """Decides, per sequence, whether the token just appended ends it (stop token or stop string)."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], tokenizer=None):
        self.stop_ids = set(eos_token_ids) | set(params.stop_token_ids)
        self.stop_strings = params.stop_strings
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass stop token ids or give the sampler a tokenizer")
        self.tokenizer = tokenizer
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    def __call__(self, generated: list[int], prev_text_len: int) -> tuple[bool, int]:
        """(stop?, length of the decoded text so far). Only the new text tail is searched."""
        if generated[-1] in self.stop_ids:
            return True, prev_text_len
        if not self.stop_strings:
            return False, prev_text_len
        assert self.tokenizer is not None  # __init__ refuses stop strings without a tokenizer
        text = self.tokenizer.decode(generated, skip_special_tokens=False)
        # A little slack: a split UTF-8 character may have decoded as U+FFFD last step.
        tail = text[max(0, prev_text_len - self._longest - 2) :]
        return any(s in tail for s in self.stop_strings), len(text)


class StepToken(NamedTuple):
    """One token a decode step appended: to sequence `index` (response order: prompt-major, then sample)."""

    index: int
    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None  # the k most likely (id, log-prob) when asked for


OnTokens = Callable[[list[StepToken]], None]
