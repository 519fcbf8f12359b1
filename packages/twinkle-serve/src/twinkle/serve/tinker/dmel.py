"""Tinker `DmelChunk` input (SDK 0.38): audio as DMel tokens (discretized log-mel filterbank channels, in a
serialized TensorContainer). Only a speech model family trained on DMel audio tokens reads them, and this
server serves none: its families read text tokens, and images where the model is a vision-language one.
So a DmelChunk is refused by name, on every route that takes a ModelInput, rather than misread as text."""

from __future__ import annotations

DMEL = "dmel"  # the chunk's `type` in JSON and its field name in the protobuf Chunk oneof


def refused(where: str) -> str:
    return (
        f"{where}: DmelChunk (audio as DMel tokens) is refused: only speech model families trained on DMel "
        "tokens take it, and this server serves none (it serves text and vision-language families)"
    )
