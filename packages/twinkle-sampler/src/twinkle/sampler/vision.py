"""Prompts with images on a Qwen-VL style model: the prefill's extra inputs and its rope positions.

A prompt's image is its placeholder tokens in the ids plus `pixel_values` / `image_grid_thw` (what
`Template.encode_prompt` and the server's image chunks produce). The model places image tokens on a
3-D (time, height, width) grid of rope positions, so the prefill passes the positions the model's
own `get_rope_index` builds for the left-padded batch; after the prompt every token is text, whose
three coordinates are equal, so decoding continues from one past the prompt's largest position.
"""

from __future__ import annotations

import numpy as np
import torch

from twinkle.processor.images import IMAGE_KEYS


def item_images(item) -> dict | None:
    """The images an encoded prompt row carries, or None."""
    if isinstance(item, dict) and item.get("pixel_values") is not None:
        return {k: item[k] for k in IMAGE_KEYS}
    return None


def prefill_inputs(model, ids_B_T: torch.Tensor, mask_B_T: torch.Tensor, images: list[dict | None]) -> dict:
    """Model kwargs (pixel_values, image_grid_thw, mm_token_type_ids, 3-D position_ids) for a prefill
    of these rows, whose images are `images` (one entry per row, None: none), or {}."""
    present = [im for im in images if im]
    if not present:
        return {}
    token = getattr(model.config, "image_token_id", None)
    rope_index = getattr(getattr(model, "model", model), "get_rope_index", None)
    if token is None or rope_index is None:
        raise ValueError(f"a prompt holds images but the model ({type(model.config).__name__}) is text-only")
    device = ids_B_T.device
    pixels = torch.cat([torch.as_tensor(np.asarray(im["pixel_values"], np.float32)) for im in present]).to(device)
    grid = torch.cat([torch.as_tensor(np.asarray(im["image_grid_thw"], np.int64)).reshape(-1, 3) for im in present])
    grid = grid.to(device)
    mm_B_T = (ids_B_T == token).int()
    found, needed = (
        int(mm_B_T.sum()),
        int(grid.prod(-1).sum()) // getattr(model.config.vision_config, "spatial_merge_size", 1) ** 2,
    )
    if found != needed:
        raise ValueError(f"the prompts hold {found} image tokens but their images make {needed}")
    pos_3_B_T, _ = rope_index(ids_B_T, mm_B_T, image_grid_thw=grid, attention_mask=mask_B_T)
    return {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": mm_B_T, "position_ids": pos_3_B_T}


def next_positions(pos) -> torch.Tensor:
    """The position of the first token after each row's prompt, from its 1-D or 3-D positions."""
    last = pos.max(0).values[:, -1] if pos.dim() == 3 else pos[:, -1]
    return last + 1
