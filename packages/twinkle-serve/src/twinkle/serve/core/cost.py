"""What one request costs the engine, in tokens, and the per-request budget every API checks before
a request is queued (`caps.max_request_tokens`): one formula per kind of work, used by the Tinker,
native and OpenAI facades alike.

- a training or forward pass: its rows x its longest row (the padded batch the engine runs);
- a sampling request: its prompts' tokens (prefilled once each) + num_samples x max_tokens per
  prompt (decoded), max_tokens unset counting as the rest of the context.

Over the budget is a 400 naming the request's cost, the budget and the config key that raises it.
Within it, long work runs in slices between other tenants' work (core/slices.py), down to points
inside one row's forward and backward and one prompt's prefill (twinkle.model.preemption): the budget
bounds what one request holds (its KV cache and activations) and how long its own queue waits behind it.
"""

from __future__ import annotations

from collections.abc import Sequence

from twinkle.serve.errors import BadRequest

KEY = "caps.max_request_tokens"


def training(lengths: Sequence[int]) -> int:
    """A pass over rows of these lengths: rows x longest row."""
    return len(lengths) * max(lengths, default=0)


def sampling(prompt_lens: Sequence[int], n: int, max_tokens: int | None, max_context: int) -> int:
    """Each prompt prefilled once and `n` samples of up to `max_tokens` decoded from it."""
    return sum(p + n * (max_tokens if max_tokens is not None else max(max_context - p, 0)) for p in prompt_lens)


def admit(tokens: int, budget: int, what: str) -> None:
    """400 when a request of `tokens` is over the per-request `budget` (the config's caps.max_request_tokens);
    `what` says how it was counted."""
    if tokens > budget:
        how = "rows x longest row" if what == "training" else "prompt tokens + num_samples x max_tokens"
        raise BadRequest(
            f"this {what} request costs {tokens} tokens ({how}), over the server's per-request budget of "
            f"{budget} tokens ({KEY} in the server config): split it into smaller requests"
            + (" or set a smaller max_tokens" if what == "sampling" else "")
            + f", or ask the operator to raise {KEY}"
        )
