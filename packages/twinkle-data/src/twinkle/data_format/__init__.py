"""twinkle.data_format: twinkle-kit's names for the shapes data takes between components.

The data layer owns the conversation and row shapes (TypedDicts, so plain dicts are valid values):
`Message`, `Trajectory` (a conversation plus what travels with it), `InputFeature` (an encoded row),
`ModelOutput` (what forward_only returns), `merge_loss_inputs` (forward_backward's old_logps /
advantages / ref_outputs as row fields) and `IGNORE_INDEX` (the label of a position without loss).
The sampling types belong to twinkle-sampler and are re-exported from there when it is installed:
`SamplingParams`, `SampledSequence`, `SampleResponse`.
"""

from __future__ import annotations

import importlib
from typing import Any, TypedDict

from twinkle.data_format.labels import IGNORE_INDEX
from twinkle.data_format.loss_inputs import merge_loss_inputs


class ToolCall(TypedDict, total=False):
    id: str
    type: str  # 'function'
    function: dict[str, Any]  # {'name': ..., 'arguments': dict or JSON string}


class Tool(TypedDict, total=False):
    type: str  # 'function'
    function: dict[str, Any]  # {'name', 'description', 'parameters'}


class Message(TypedDict, total=False):
    role: str  # 'system' | 'user' | 'assistant' | 'tool'
    content: str | list[dict[str, Any]]  # text, or parts ({'type': 'text'|'image'|'image_url', ...})
    tool_calls: list[ToolCall]
    reasoning_content: str


class Trajectory(TypedDict, total=False):
    messages: list[Message]
    tools: list[Tool]
    user_data: list[Any]  # what a preprocessor carries for the reward (e.g. the ground truth)
    ground_truth: str


class InputFeature(TypedDict, total=False):
    input_ids: list[int]
    labels: list[int]  # -100 where no loss is taken
    attention_mask: list[int]
    position_ids: list[int]
    pixel_values: Any
    image_grid_thw: Any


class ModelOutput(TypedDict, total=False):
    loss: float | None
    logprobs: list[list[float]]  # per row, aligned with its labels (0.0 at position 0)


class LossOutput(TypedDict, total=False):
    loss: float
    num_tokens: int


_SAMPLING = ("SamplingParams", "SampledSequence", "SampleResponse")


def __getattr__(name: str) -> type:
    if name in _SAMPLING:  # owned by twinkle-sampler, above this layer: looked up only when asked for
        try:
            return getattr(importlib.import_module("twinkle.sampler.params"), name)
        except ModuleNotFoundError as e:
            raise ImportError(f"twinkle.data_format.{name} is twinkle-sampler's: pip install 'twinkle-sampler'") from e
    raise AttributeError(f"module 'twinkle.data_format' has no attribute {name!r}")


__all__ = [
    "IGNORE_INDEX",
    "InputFeature",
    "LossOutput",
    "Message",
    "ModelOutput",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "Tool",
    "ToolCall",
    "Trajectory",
    "merge_loss_inputs",
]
