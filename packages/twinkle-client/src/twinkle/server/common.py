"""`input_feature_to_datum`: an encoded row as the Tinker SDK's Datum (twinkle-kit's helper, ours).

Tinker's `target_tokens[t]` is the token to predict after position t, so the Datum holds the row
shifted by one: `model_input = input_ids[:-1]`, `target_tokens = labels[1:]`, `weights` 1 where that
label is not -100 (its target token written as 0 otherwise). twinkle-kit's helper sends the labels
unshifted and relies on its own server to undo that; an unmodified Tinker server (ours) takes the
Datum as the SDK defines it, so the shift happens here. Needs the Tinker SDK (`pip install tinker`).
"""

from __future__ import annotations

from collections.abc import Mapping

from twinkle.client.schema import IGNORE_INDEX


def _ints(value) -> list[int]:
    value = value.tolist() if hasattr(value, "tolist") else value
    if value and isinstance(value[0], list):  # a [1, T] batch of one row
        if len(value) != 1:
            raise ValueError(f"input_feature_to_datum takes one row, got a batch of {len(value)}")
        value = value[0]
    return [int(t) for t in value]


def input_feature_to_datum(input_feature: Mapping):
    """A `tinker.types.Datum` (cross-entropy inputs: target_tokens and weights) from one encoded row."""
    try:
        from tinker import types
    except ImportError as e:
        raise ImportError("input_feature_to_datum builds the Tinker SDK's Datum: pip install tinker") from e
    tokens = _ints(input_feature["input_ids"])
    if len(tokens) < 2:
        raise ValueError("a row needs at least 2 tokens to predict one")
    labels = _ints(input_feature["labels"]) if input_feature.get("labels") is not None else tokens
    if len(labels) != len(tokens):
        raise ValueError(f"{len(labels)} labels for {len(tokens)} input_ids")
    targets = labels[1:]
    weights = [0.0 if t == IGNORE_INDEX else 1.0 for t in targets]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[0 if t == IGNORE_INDEX else t for t in targets], dtype="int64"),
            "weights": types.TensorData(data=weights, dtype="float32"),
        },
    )
