"""Initial weights that come out bit-identical on every CPU.

torch's `normal_` (what transformers' `_init_weights` uses) has a vectorised AVX2 path and a scalar
path, and they differ in the last bits: a build on a CPU that takes the scalar path (an ARM laptop,
`ATEN_CPU_CAPABILITY=default`) would not match the pinned digest and would be refused. So the embedded
presets redraw every random tensor from numpy's PCG64 with nothing but exact operations: a 53-bit
integer scaled by a power of two, one multiply and one subtract in float64 (each rounded once, by
IEEE rules, on any hardware), one rounding to float32. The draw is uniform with the standard
deviation the config asks for; for a tiny random model only the scale matters.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch


def _uniform(name: str, shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    # One stream per tensor, keyed by its name: adding a module never shifts the others' values.
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
    half_width = std * 3.0**0.5  # U(-h, h) has standard deviation h / sqrt(3)
    return ((2.0 * rng.random(shape, dtype=np.float64) - 1.0) * half_width).astype(np.float32)


def portable_init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Redraw, in place, every parameter that is not a constant (matrices, embeddings, experts; a norm's
    ones and a bias's zeros stay); an embedding's padding row stays zero, as transformers leaves it."""
    import torch

    padding = {
        f"{name}.weight": m.padding_idx
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_meta:  # built for its shapes only (no values to draw)
                continue
            if not p.dtype.is_floating_point or (p.ndim < 2 and bool((p == p.flatten()[0]).all())):
                continue
            p.copy_(torch.from_numpy(_uniform(name, tuple(p.shape), std, seed)))
            if name in padding:
                p[padding[name]] = 0.0
