"""What Tinker's asample asks beyond sampling, and its answer: prompt log-probs of the last N positions
only, the log-probs of chosen token ids at every prompt position (`target_prompt_logprobs`, -1: no id),
and k alternative tokens drawn at every prompt position (`prompt_alt_tokens`).

The backend samples plain twinkle.sampler requests; the two prompt-table answers are computed here from
the prompt's full next-token distributions, by `score_table` run where the sampler is
(Backend.reduce_prompt_table), so only [len(prompt) - 1, K] arrays ever leave a sampler rank.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np

from twinkle.sampler import SampledSequence, SampleResponse, SamplingParams
from twinkle.serve.backend import Backend

TopK = list[tuple[int, float]]  # (token id, log-prob) pairs, most likely first


@dataclass(frozen=True)
class PromptAsks:
    """An asample's options that are not sampling options (sample_params.sample_params reads them)."""

    prompt_logprobs: bool = False
    topk_prompt: int = 0  # the k most likely tokens at every prompt position
    topk_sample: int = 0  # ... and at every sampled position
    prompt_logprobs_last_n: int | None = None  # score only the last N prompt positions (the rest None)
    target_prompt_ids: np.ndarray | None = None  # int64 [len(prompt) - 1, K], row i at prompt position i + 1
    target_layout: tuple | None = None  # the sparse CSR layout target_prompt_ids came in, to answer in
    prompt_alt_tokens_k: int = 0  # draws at the sampling temperature at every prompt position


@dataclass
class TinkerSampleResult:
    """One asample's answer as codec.encode_sample_result writes it."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[TopK | None] | None = None  # one row per prompt position (None: not scored)
    target_prompt_logprobs: np.ndarray | None = None  # float32, target_prompt_ids' shape; 0.0 where it has -1
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None  # (int64 ids, float32 log-probs) [len - 1, k]
    prompt_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the sampler's prefix cache


def answer(
    backend: Backend,
    sampler: str | None,
    prompt: list[int],
    response: SampleResponse,
    asks: PromptAsks,
    params: SamplingParams,
    images=None,
) -> TinkerSampleResult:
    """The sampler's response as Tinker's answer, with a second prefill where the prompt table is asked for."""
    last_n = asks.prompt_logprobs_last_n
    scored = _from_position(len(prompt) - last_n if last_n is not None else 0)
    result = TinkerSampleResult(
        response.sequences,
        scored(response.prompt_logprobs) if asks.prompt_logprobs else None,
        scored(response.prompt_top_logprobs) if asks.topk_prompt else None,
        prompt_cache_hit_tokens=response.cached_prompt_tokens,
    )
    targets, k = asks.target_prompt_ids, asks.prompt_alt_tokens_k  # checked against the prompt: codec
    if targets is not None or k:
        seed = params.seed if params.seed is not None else random.randrange(2**62)
        reduce = functools.partial(score_table, targets=targets, k=k, temperature=params.temperature, seed=seed)
        result.target_prompt_logprobs, result.prompt_alt_tokens = backend.reduce_prompt_table(
            sampler, prompt, reduce, images=images
        )
    return result


def score_table(table_T_V, targets: np.ndarray | None, k: int, temperature: float, seed: int):
    """(the log-probs of `targets` (0.0 where -1) or None, k draws per row with their log-probs or None)."""
    import torch

    scores = None
    if targets is not None:
        ids = torch.from_numpy(targets).clamp(min=0)
        scores = table_T_V.gather(1, ids).masked_fill(torch.from_numpy(targets) < 0, 0.0).numpy()
    return scores, (_draw_alternatives(table_T_V, k, temperature, seed) if k else None)


def _draw_alternatives(table_T_V, k: int, temperature: float, seed: int):
    """k draws with replacement at `temperature` from each row's distribution -> (ids, their model log-probs)."""
    import torch

    from twinkle.sampler.decoding import row_seed

    if temperature == 0 or table_T_V.shape[0] == 0:
        ids_T_K = table_T_V.argmax(-1, keepdim=True).expand(-1, k)
    else:
        # seeded like the request's samples, on a stream of its own (sample index -1)
        g = torch.Generator().manual_seed(row_seed(seed, -1))
        shifted_T_V = table_T_V - table_T_V.max(-1, keepdim=True).values  # a tiny temperature must not give NaN
        # below float32's smallest normal (5e-324 arrives from JSON) the divisor would round to 0 (0/0 = NaN)
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
        ids_T_K = torch.multinomial(torch.softmax(shifted_T_V / temperature, dim=-1), k, replacement=True, generator=g)
    return ids_T_K.numpy().astype(np.int64), table_T_V.gather(1, ids_T_K).numpy().astype(np.float32)


def _from_position(first: int):
    """A function that blanks (None) a per-prompt-position list before `first` (prompt_logprobs_last_n)."""
    return lambda rows: None if rows is None else [None] * first + list(rows[first:])
