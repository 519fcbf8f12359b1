"""Tinker's training conventions, applied here so that the core and the backend see only the engine's
rows and outcomes: the datums a request carries, the checks they pass before any kernel sees them (bad
input is the user's error), the one-token shift onto the engine's rows, the loss a request names, and
its result's `name:reduction` metrics.

The shift: `input_ids = tokens + [last target]`, `labels = [-100] + target_tokens`, per-token loss
inputs prefixed by one 0. The engine predicts labels[t+1] from input_ids[:t+1], which is exactly
Tinker's "position t predicts target_tokens[t]" (the appended token only feeds a position whose logits
are dropped).

`target_tokens` of shape [N, K] score K ids at each position (a teacher's top-K, a decision's K
choices): cross_entropy is then -Σ_t Σ_k weights[t, k] · log p(target_tokens[t, k]) with `weights`
of the same shape, and the pass answers log-probs [N, K]. They travel as the engine's `target_ids`
field [N + 1, K] (twinkle.loss.sft), `weights` beside them, every datum padded to the request's widest
K with weight 0; the labels are the first column (every position scored). The per-token policy losses
are defined on the one sampled token per position, and refuse K > 1.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from twinkle.serve.backend.base import RowsPass, UserError
from twinkle.serve.tinker import kit_dpo

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
# The most ids one position may score: a [N, K] request costs K gathered log-probs per position (and, in
# a chunked head's backward, K head rows per position); Tinker's top-K prompt log-probs go to 20
MAX_TARGET_IDS = 64


@dataclass
class Datum:
    """One training example: `tokens` (model input) and per-position loss inputs of the same length."""

    tokens: np.ndarray | list[int]  # int64 [N] as the Tinker codec decodes it
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    # images: before expansion the chunks as sent (tinker/images.py), after it the model's
    # {"pixel_values", "image_grid_thw"} for the image tokens already in `tokens`
    images: Any = None


@dataclass
class TinkerForwardResult:
    logprobs: list[np.ndarray]  # per datum: log p(target_tokens[t]) as float32 [N], or [N, K] for [N, K] targets
    metrics: dict[str, float]  # keys `name:reduction`
    mfu: float | None = None  # this request's share of the pass as a fraction of the matmul peak (run curves)


def make_loss(loss_fn: str, config: dict):
    """The twinkle.loss object for a Tinker loss name, summed over tokens as Tinker defines its losses.
    The config's names are checked against the loss's parameters before it is built, so a TypeError
    from inside the constructor stays what it is: a bug (a 500 with its traceback), not the client's."""
    from twinkle.loss import LOSSES

    if loss_fn not in TINKER_LOSSES:
        raise UserError(f"unknown loss_fn {loss_fn!r}; supported: {', '.join(TINKER_LOSSES)}")
    cls = LOSSES.get(loss_fn)
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = [n for n, p in inspect.signature(cls).parameters.items() if p.kind in named and n != "reduction"]
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise UserError(f"bad loss_fn_config for {loss_fn!r}: it takes {known or 'no options'}, not {unknown}")
    try:
        return cls(reduction="sum", **config)
    except ValueError as e:  # the loss's own range checks, naming the option
        raise UserError(f"bad loss_fn_config for {loss_fn!r}: {e}") from None


def target_width(d: Datum) -> int | None:
    """K for a datum whose target_tokens are [N, K], None for [N]."""
    targets = d.inputs.get("target_tokens")
    return int(targets.shape[1]) if targets is not None and targets.ndim == 2 else None


def _check_shapes(i: int, d: Datum, loss_fn: str) -> None:
    n, k = len(d.tokens), target_width(d)
    if k is None or (k == 1 and loss_fn in TINKER_LOSSES and loss_fn != "cross_entropy"):
        for key, arr in d.inputs.items():  # a policy loss's [N, 1] targets are its [N]
            if arr.size != n:
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{key!r}] has {arr.size} values for a model "
                    f"input of {n} tokens (shape mismatch)"
                )
        return
    shape = list(d.inputs["target_tokens"].shape)
    if shape[0] != n:
        raise UserError(
            f"datum {i}: loss_fn_inputs['target_tokens'] has shape {shape} for a model input of {n} tokens "
            f"(shape mismatch: [{n}] or [{n}, K])"
        )
    if not 1 <= k <= MAX_TARGET_IDS:
        raise UserError(
            f"datum {i}: loss_fn_inputs['target_tokens'] has shape {shape}: K = {k} ids per position, "
            f"outside [1, MAX_TARGET_IDS = {MAX_TARGET_IDS}]"
        )
    if loss_fn in TINKER_LOSSES and loss_fn != "cross_entropy":
        raise UserError(
            f"datum {i}: loss {loss_fn!r} is defined per sampled token and takes target_tokens of shape [{n}], "
            f"got {shape}; [N, K] targets train with 'cross_entropy' or a custom loss"
        )
    for key, arr in d.inputs.items():
        if key in ("target_tokens", "weights") and list(arr.shape) != shape:
            raise UserError(
                f"datum {i}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}; with target_tokens of "
                f"shape {shape} it needs that shape"
            )
        if key not in ("target_tokens", "weights") and arr.size != n:
            raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {arr.size} values for {n} tokens")


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
        _check_shapes(i, d, loss_fn)
        for key, arr in d.inputs.items():
            if key != "target_tokens" and not np.all(np.isfinite(arr)):
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] contains NaN or inf")
        for label, arr in (
            ("model_input", np.asarray(d.tokens, dtype=np.int64)),
            ("target_tokens", d.inputs["target_tokens"].astype(np.int64).reshape(-1)),
        ):
            bad = arr[(arr < 0) | (arr >= vocab_size)]
            if bad.size:
                raise UserError(f"datum {i}: {label} token {int(bad[0])} is outside the vocabulary [0, {vocab_size})")


def _shifted(arr: np.ndarray) -> np.ndarray:
    """A per-token input prefixed by one zero position (of its width), as float32."""
    arr = arr.astype(np.float32)
    return np.concatenate([np.zeros((1, *arr.shape[1:]), np.float32), arr])


def _padded(arr: np.ndarray, k: int) -> np.ndarray:
    return np.pad(arr, ((0, 0), (0, k - arr.shape[1])))


def rows(data: list[Datum]) -> list[dict]:
    """The shift as arrays (input ids, labels, per-token fields): the engine's collate makes each a
    tensor once. [N, K] targets become the `target_ids` field with their weights (ones when none were
    sent), both padded to the widest K with weight 0."""
    widest = max((target_width(d) or 0) for d in data) if data else 0
    out = []
    for d in data:
        targets = d.inputs["target_tokens"].astype(np.int64)
        k = target_width(d)
        if k is not None and "weights" not in d.inputs:
            d = Datum(d.tokens, {**d.inputs, "weights": np.ones(targets.shape, np.float32)}, d.images)
        first = targets[:, 0] if k is not None else targets.reshape(-1)
        ids = np.concatenate([np.asarray(d.tokens, dtype=np.int64), first[-1:]])
        row = {"input_ids": ids, "labels": np.concatenate([[-100], first]), **(d.images or {})}
        if k is not None:  # ids as float32 are exact below 2**24, far past any vocabulary
            row["target_ids"] = _shifted(_padded(targets, widest))
        for key, arr in d.inputs.items():
            if key != "target_tokens":
                row[key] = _shifted(_padded(arr, widest) if k is not None and key == "weights" else arr.reshape(-1))
        out.append(row)
    return out


def training_pass(
    adapter: str,
    data: list[Datum],
    loss_fn: str,
    loss_config: dict,
    forward_only: bool,
    backend,
    loss=None,
) -> RowsPass:
    """A Tinker forward(_backward) as the engine's pass: checked datums shifted onto rows, scored by the
    loss the request names (`loss`: one built already, a custom loss with its per-datum inputs).
    `weights` are cross-entropy's: another loss reads them from nowhere, so they are not sent on.
    twinkle-kit's conventions (a base-model forward, DPO by `ref_logps`) are tinker/kit_dpo.py's."""
    kit = kit_dpo.loss_for(loss_fn, loss_config, data, forward_only) if loss is None else None
    check_datums(data, "cross_entropy" if kit is not None else loss_fn, backend.vocab_size, backend.max_context)
    if kit is not None:
        if any(target_width(d) is not None for d in data):
            raise UserError("twinkle-kit's base-model forward and DPO take target_tokens of shape [N], not [N, K]")
        return RowsPass(adapter, kit_dpo.rows_for(kit, rows(data)), forward_only, kit)
    if loss is None:
        loss = make_loss(loss_fn, loss_config)
    if loss_fn != "cross_entropy":
        data = [_without_weights(d, flat=loss_fn in TINKER_LOSSES) for d in data]
    return RowsPass(adapter, rows(data), forward_only, loss)


def _without_weights(d: Datum, flat: bool) -> Datum:
    """A datum for a loss other than cross_entropy; `flat`: a policy loss's [N, 1] targets (checked) as [N]."""
    inputs = {k: v for k, v in d.inputs.items() if k != "weights"}
    if flat:
        inputs["target_tokens"] = inputs["target_tokens"].reshape(-1)
    return Datum(d.tokens, inputs, d.images)


def forward_result(outcome, data: list[Datum] | None = None) -> TinkerForwardResult:
    """The engine's outcome of a Tinker pass as the SDK reads it: per-datum log-probs ([N, K] for a datum
    of [N, K] targets, cut back from the request's widest K), the summed loss as `loss:sum`, a loss's own
    metrics as token means unless it names its reduction (a custom loss's)."""
    if isinstance(outcome, Exception):  # the backend's UserError for this request, or the pass's own failure
        raise outcome
    if not outcome["finite"]:
        # not back-propagated by the engine: the adapter's gradients are untouched
        raise UserError(f"loss is {outcome['loss']} (not finite): no gradient was applied")
    logprobs = [np.asarray(lp, dtype=np.float32) for lp in outcome["logprobs"]]
    for i, d in enumerate(data or []):
        k = target_width(d)
        if k is not None:
            logprobs[i] = logprobs[i].reshape(len(d.tokens), -1)[:, :k]
    metrics = {"loss:sum": float(outcome["loss"])}
    metrics.update(
        {k if k.endswith((":sum", ":mean")) else f"{k}:mean": float(v) for k, v in outcome.get("metrics", {}).items()}
    )
    return TinkerForwardResult(logprobs, metrics, outcome.get("mfu"))


def train(backend, adapter: str, data: list[Datum], loss_fn: str, loss_config: dict, forward_only: bool):
    """One Tinker forward(_backward) on `backend` now, unqueued (tests, the in-process benchmark)."""
    (outcome,) = backend.forward_backward_many(
        [training_pass(adapter, data, loss_fn, loss_config, forward_only, backend)]
    )
    return forward_result(outcome, data)
