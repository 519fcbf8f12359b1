"""twinkle-kit's shape of a sampled sequence's log-probs, for its `vLLMSampler` (kit_vllm.py).

twinkle-kit's `SampledSequence.logprobs` is, per generated token, a list of (token id, log-prob) pairs:
with `logprobs=1` (or True) the one pair of the sampled token, so its GRPO scripts read the old policy's
log-probs as `[lp[0][1] for lp in sequence.logprobs]`; with `logprobs=k > 1` the k most likely tokens,
most likely first (the sampled token among them only where it ranks in the top k). Ours keep the sampled
token's log-prob as a float per token and the alternatives in `top_logprobs`; `VLLMSampler` and
`TorchSampler` keep that. `logprobs=0` / False gives None here (twinkle-kit's `logprobs=0` gives an
empty list per token, and its default, None, gives None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twinkle.sampler.params import SampledSequence, SamplingParams


@dataclass
class KitSampledSequence(SampledSequence):
    """A SampledSequence whose `logprobs` are twinkle-kit's per-token (token id, log-prob) pairs.
    `routed_experts` is twinkle-kit's field for routing replay R3, which this sampler does not offer
    (always None)."""

    # twinkle-kit's shape over ours on purpose: only the kit sampler builds these, for kit scripts
    logprobs: list[list[tuple[int, float]]] | None  # ty: ignore[incompatible-attribute-override]
    routed_experts: Any = None


def kit_pairs(sequence: SampledSequence, params: SamplingParams) -> list[list[tuple[int, float]]] | None:
    """`sequence.logprobs` in twinkle-kit's shape for what `params.logprobs` asked."""
    k = 0 if params.logprobs is False else max(int(params.logprobs), 0)
    if k == 0 or sequence.logprobs is None:
        return None
    if k == 1:
        return [[(token, float(lp))] for token, lp in zip(sequence.tokens, sequence.logprobs)]
    if sequence.top_logprobs is None:
        raise RuntimeError(f"logprobs={k}: the sampler returned no top-{k} log-probs to give")
    return [[(token, float(lp)) for token, lp in step] for step in sequence.top_logprobs]


def as_kit_sequence(sequence: SampledSequence, params: SamplingParams) -> KitSampledSequence:
    """The same continuation, its log-probs in twinkle-kit's shape (`top_logprobs` kept as they were)."""
    return KitSampledSequence(
        tokens=sequence.tokens,
        logprobs=kit_pairs(sequence, params),
        stop_reason=sequence.stop_reason,
        text=sequence.text,
        top_logprobs=sequence.top_logprobs,
    )
