"""From what a training loop passes (encoded rows or raw chats) to the wire's `Inputs`.

Encoded rows (dicts with `input_ids`) go as they are: numbers and lists of numbers beside
`input_ids`/`labels` become loss-input fields; text columns stay home. Raw chats are encoded here
when twinkle-data (the Template) is installed and the base model's tokenizer is reachable, so the
server only runs the model; otherwise the messages travel and the server encodes them with the
model's own chat template.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from twinkle.client import images
from twinkle.client.schema import EncodedRow, Inputs, Message, Trajectory

log = logging.getLogger("twinkle.client")
_SKIP = {"input_ids", "labels", "attention_mask", "position_ids", "messages", "tools", "image_grid_thw"}


def _plain(value):
    return value.tolist() if hasattr(value, "tolist") else value


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fields(row: Mapping) -> dict:
    out = {}
    for key, value in row.items():
        value = _plain(value)
        if key in _SKIP:
            continue
        if _is_number(value) or (isinstance(value, list) and value and all(_is_number(x) for x in value)):
            out[key] = value
    return out


def _messages(row) -> list:
    if isinstance(row, Mapping) and "messages" in row:
        return list(row["messages"])
    if isinstance(row, Sequence) and not isinstance(row, str) and all(isinstance(m, Mapping) for m in row):
        return list(row)
    raise ValueError(
        f"a row must be an encoded row (with 'input_ids') or a chat (a list of messages, or a "
        f"dict with 'messages'); got {type(row).__name__}"
    )


class LocalEncoder:
    """Encodes chats with twinkle-data's Template for `base_model`, if that works on this machine."""

    def __init__(self, base_model: str, mode: str = "auto", template=None):
        if mode not in ("auto", "local", "server"):
            raise ValueError(f"encode must be 'auto', 'local' or 'server', got {mode!r}")
        self.base_model, self.mode, self._template = base_model, mode, template

    def template(self):
        if self.mode == "server":
            return None
        if self._template is None:
            try:
                from twinkle.template import Template

                self._template = Template(model_id=self.base_model)
            except Exception as e:
                if self.mode == "local":
                    raise RuntimeError(f"cannot encode locally for {self.base_model!r}: {e}") from e
                log.info("encoding chats on the server (%s: %s)", type(e).__name__, e)
                self._template = False
        return self._template or None


def to_inputs(inputs, encoder: LocalEncoder | None = None) -> Inputs:
    if isinstance(inputs, Mapping):
        inputs = [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, str) or not inputs:
        raise ValueError(f"inputs must be a non-empty list of rows, got {type(inputs).__name__}")
    if isinstance(inputs[0], Mapping) and "role" in inputs[0]:
        inputs = [inputs]  # one chat given as its message list
    encoded = [isinstance(r, Mapping) and "input_ids" in r for r in inputs]
    if any(isinstance(r, Mapping) and r.get("pixel_values") is not None for r in inputs):
        raise ValueError(
            "encoded rows with pixel_values cannot be sent: send the chat with its images instead "
            "(the server computes the pixels with its model's image processor)"
        )
    chats = [_messages(r) for r, done in zip(inputs, encoded) if not done]
    with_images = any(images.has_images(m) for m in chats)
    # a chat with images is encoded by the server: pixels never travel, the images' bytes do
    template = encoder.template() if encoder is not None and not all(encoded) and not with_images else None
    if all(encoded) or template is not None:
        rows = []
        for row, is_encoded in zip(inputs, encoded):
            full: Mapping = row if isinstance(row, Mapping) else {}  # an encoded row is always a Mapping
            if not is_encoded:
                assert template is not None  # a chat in the batch means the template was found above
                done = template.encode({"messages": _messages(row)})
                if done is None:
                    raise ValueError("a chat is longer than the template's max_length")
                full = {**full, **done}
            labels = _plain(full.get("labels"))
            rows.append(EncodedRow(input_ids=_plain(full["input_ids"]), labels=labels, fields=_fields(full)))
        return Inputs(rows=rows)
    if any(encoded):
        raise ValueError(
            "mix of encoded rows and chats in one batch: install twinkle-data to encode the chats "
            "here, or send them in separate calls"
        )
    return Inputs(
        trajectories=[
            Trajectory(
                messages=[Message.model_validate(m) for m in images.wire_messages(_messages(r))],
                fields=_fields(r) if isinstance(r, Mapping) else {},
            )
            for r in inputs
        ]
    )
