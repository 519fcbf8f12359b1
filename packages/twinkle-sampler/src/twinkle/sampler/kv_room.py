"""A decode's KV cache with room to grow: each step writes its token's keys and values in place.

transformers' DynamicLayer appends by `torch.cat`, which copies the whole cache at every step: at the
Qwen3-0.6B shape, 8 rows past a 128-token prompt, ~150 MB a step across 28 layers (issue 47), more
than the step's attention reads. A RoomyLayer keeps the cache in a buffer with room for the decode's
remaining tokens and hands the model views of its filled part; any call that replaces the layer's
tensors (rows leaving the batch, a group's rows repeated) makes the next append move to a new buffer.
A RoomyLayer with a `buffer_dtype` keeps its buffers in that dtype: a half-precision model's keys and values
held exactly in float32, for decode_attention's float32 kernel.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class RoomyLayer(DynamicLayer):
    room = 0  # tokens of spare room a new buffer gets
    buffer_dtype: torch.dtype | None = None  # of a new buffer (None: the cached tensors')
    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None or keys.numel() == 0:
            return super().update(key_states, value_states, *args, **kwargs)
        self.keys, self.key_buffer = _append(keys, key_states, self.key_buffer, self.room, self.buffer_dtype)
        self.values, self.value_buffer = _append(values, value_states, self.value_buffer, self.room, self.buffer_dtype)
        return self.keys, self.values


def _append(
    cached_B_H_T_D: torch.Tensor,
    new_B_H_N_D: torch.Tensor,
    buffer: torch.Tensor | None,
    room: int,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cached + new along T, the buffer it is a view of): written into the room behind `cached` when
    `cached` is still the front of `buffer` and the room is enough, else into a new buffer (in `dtype`,
    default cached's) with `room` tokens to spare."""
    b, h, t, d = cached_B_H_T_D.shape
    n = new_B_H_N_D.shape[-2]
    if not (  # `cached` is exactly buffer[:, :, :t] of a buffer with room for n more
        buffer is not None
        and (buffer.shape[0], buffer.shape[1], buffer.shape[3]) == (b, h, d)
        and buffer.shape[2] >= t + n
        and buffer.data_ptr() == cached_B_H_T_D.data_ptr()
        and buffer.stride() == cached_B_H_T_D.stride()
    ):
        buffer = cached_B_H_T_D.new_empty((b, h, t + max(n, room), d), dtype=dtype or cached_B_H_T_D.dtype)
        buffer[:, :, :t].copy_(cached_B_H_T_D)
    buffer[:, :, t : t + n].copy_(new_B_H_N_D)
    return buffer[:, :, : t + n], buffer


def float32_bytes(cache, tokens: int) -> int:
    """Bytes of `cache`'s keys and values in float32 once `tokens` more are appended to every row."""
    total = 0
    for layer in getattr(cache, "layers", None) or []:
        for t in (layer.keys, layer.values):
            if t is not None and t.dim() == 4:
                b, h, n, d = t.shape
                total += b * h * (n + tokens) * d * 4
    return total


def make_room(cache, tokens: int, dtype: torch.dtype | None = None) -> None:
    """Turn the plain DynamicLayers of `cache` into RoomyLayers with room for `tokens` more tokens, their
    buffers in `dtype` (None: the cache's own)."""
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            roomy = RoomyLayer.__new__(RoomyLayer)
            roomy.__dict__.update(layer.__dict__)
            roomy.room, roomy.buffer_dtype = tokens, dtype
            layers[i] = roomy
