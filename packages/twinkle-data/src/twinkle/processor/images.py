"""Image columns of encoded rows to the tensors a vision-language model takes.

Each row encoded from a conversation with images carries ``pixel_values`` (one row of patch values
per vision patch) and ``image_grid_thw`` (one ``[t, h, w]`` per image). A Qwen-VL style model takes
every image of the batch at once: the patches of all rows concatenated in row order, and the grids
likewise; the model matches them to the image tokens of ``input_ids`` in the same order.
"""

from __future__ import annotations

import numpy as np
import torch

IMAGE_KEYS = ("pixel_values", "image_grid_thw")


def collate_images(rows: list[dict]) -> dict[str, torch.Tensor]:
    """``{'pixel_values': [patches, dim] float32, 'image_grid_thw': [images, 3] long}``, or {} when
    no row holds an image."""
    pixels, grids = [], []
    for i, row in enumerate(rows):
        if row.get("pixel_values") is None:
            continue
        p = np.asarray(row["pixel_values"], dtype=np.float32)
        g = np.asarray(row["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
        if p.shape[0] != int(g.prod(axis=1).sum()):
            raise ValueError(
                f"batch row {i}: {p.shape[0]} image patches, but its image grids {g.tolist()} need {int(g.prod(axis=1).sum())}"
            )
        pixels.append(p)
        grids.append(g)
    if not pixels:
        return {}
    return {
        "pixel_values": torch.from_numpy(np.concatenate(pixels)),
        "image_grid_thw": torch.from_numpy(np.concatenate(grids)),
    }
