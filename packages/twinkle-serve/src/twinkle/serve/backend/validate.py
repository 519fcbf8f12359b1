"""Checks every backend applies to Tinker datums before any kernel sees them (bad input = user error)."""

from __future__ import annotations

import numpy as np

from twinkle.serve.backend.base import Datum, UserError

# Losses a Tinker client may name, and the loss_fn_inputs each needs besides target_tokens.
TINKER_LOSSES = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
    # logprobs (and sampled_mask) come from the server's records: tinker/provenance.py
    "stable_reinforce": ("logprobs", "advantages"),
}


def make_loss(loss_fn: str, config: dict):
    """The twinkle.loss object for a Tinker loss name, summed over tokens as Tinker defines its losses."""
    from twinkle.loss import create_loss

    if loss_fn not in TINKER_LOSSES:
        raise UserError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(TINKER_LOSSES)}")
    try:
        return create_loss(loss_fn, reduction="sum", **config)
    except (TypeError, ValueError) as e:
        raise UserError(f"bad loss_fn_config for {loss_fn!r}: {e}") from None


def check_datums(data: list[Datum], loss_fn: str, vocab_size: int, max_context: int) -> None:
    if not data:
        raise UserError("forward_backward needs at least one datum")
    needed = ("target_tokens", *TINKER_LOSSES.get(loss_fn, ()))
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise UserError(f"datum {i} has no tokens")
        if n + 1 > max_context:
            raise UserError(f"datum {i}: {n} tokens exceed the model's context of {max_context}")
        for key in needed:
            if key not in d.inputs:
                raise UserError(f"datum {i}: loss {loss_fn!r} needs loss_fn_inputs[{key!r}]")
        for key, arr in d.inputs.items():
            if arr.size != n:
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{key!r}] has {arr.size} values for a model "
                    f"input of {n} tokens (shape mismatch)"
                )
            if key != "target_tokens" and not np.all(np.isfinite(arr)):
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or inf")
        for label, arr in (
            ("model_input", np.asarray(d.tokens, dtype=np.int64)),
            ("target_tokens", d.inputs["target_tokens"].astype(np.int64).reshape(-1)),
        ):
            bad = arr[(arr < 0) | (arr >= vocab_size)]
            if bad.size:
                raise UserError(f"datum {i}: {label} token {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
