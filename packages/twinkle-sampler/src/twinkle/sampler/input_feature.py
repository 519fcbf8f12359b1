"""twinkle-kit's `SampledSequence.new_input_feature`: a prompt and one sampled continuation as a row
ready for training (`TransformersModel.forward_backward`) and for rewards that read the chat.

`input_ids` = prompt + continuation, `labels` = the prompt's labels (-100 where it had none) then the
continuation's tokens, aligned with input_ids as our rows are (twinkle-kit shifts its labels inside the
template). The prompt's other keys come along (what a dataset row carries: ground truth, user data);
a chat's `messages` gain the continuation's text as an assistant turn; per-token values of the prompt's
length other than labels (attention mask, positions) are dropped, since they no longer fit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

IGNORE_INDEX = -100


def _per_token(value: Any, length: int) -> bool:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return isinstance(value, list) and len(value) == length and all(isinstance(v, (int, float, list)) for v in value)


def build_input_feature(
    prompt_tokens: Sequence[int], tokens: Sequence[int], text: str | None = None, prompt: Any = None
) -> dict[str, Any]:
    """The row for `prompt_tokens` + `tokens`; `prompt` is the item the sampler was given (an encoded
    row, a dict with messages, a chat, a string, token ids), `text` the continuation's decoded text."""
    P = len(prompt_tokens)
    if isinstance(prompt, Mapping):
        base = {k: v for k, v in prompt.items() if k in ("input_ids", "labels") or not _per_token(v, P)}
    elif isinstance(prompt, list) and prompt and all(isinstance(m, Mapping) and "role" in m for m in prompt):
        base = {"messages": prompt}
    else:
        base = {}
    labels = base.get("labels")
    labels = labels.tolist() if hasattr(labels, "tolist") else labels
    prompt_labels = list(labels) if isinstance(labels, list) and len(labels) == P else [IGNORE_INDEX] * P
    feature = {
        **base,
        "input_ids": [*prompt_tokens, *tokens],
        "labels": [*prompt_labels, *tokens],
    }
    messages = base.get("messages")
    if isinstance(messages, list) and text is not None:
        feature["messages"] = [*messages, {"role": "assistant", "content": text}]
    return feature
