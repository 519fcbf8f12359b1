"""Keeping a training step's heap as small as what it holds.

glibc serves every tensor below its mmap threshold (up to 32 MiB once a large block has been freed)
and every small object (autograd nodes, tensor headers) from one heap. A small object that outlives
the tensors freed around it pins the middle of their freed stretch; the next layer's activations,
the same sizes again, no longer fit there, and the heap grows. Measured at the Qwen3-0.6B shape
(LoRA r16, 4 x 512 tokens, 28 layers, bf16 base, activation checkpointing): the heap grew 55 MB a layer
in forward and 40-90 MB a layer in backward, to a 4.8-5.3 GiB peak RSS for ~0.6 GiB of live tensors
(glibc's own count: 0.3 GiB in use, 2.8 GiB free in the heap after the step). Two things pinned it:
- the non-reentrant checkpoint builds each layer's autograd graph in forward (its nodes and saved-
  tensor holders live until backward) while the layer's activations come and go around them. The
  reentrant checkpoint runs the layer's forward without a graph and builds it only in the recompute,
  right before backward consumes it: `reentrant_checkpointing_fits` says where the engine uses it.
- each LoRA factor's gradient (64-192 KiB) is allocated mid-backward and kept until the step.
  `gradients_in_one_buffer` gives them one buffer, allocated once, that backward accumulates into.
Together they took that step's peak RSS to 3.0 GiB with no extra page faults; the other way out,
a low mmap threshold (`M_MMAP_THRESHOLD`, every large tensor its own mapping), measured 2.4-3.0 GiB
but cost 11-16M page faults a step (+8-20% CPU time): every activation on fresh zeroed pages.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from twinkle.patch.base import PatchTarget


def reentrant_checkpointing_fits(model: PatchTarget) -> bool:
    """Whether TransformersModel `model` checkpoints its layers reentrantly: a model trained in one
    process and not compiled. Data, tensor and context parallel runs keep the non-reentrant
    checkpoint (their collectives and FSDP2's hooks are only verified with it), and a compiled layer
    would compile a second graph for the forward without gradients."""
    from twinkle.model.compile import language_layers
    from twinkle.model.strategy import data_parallel_size, tensor_parallel_size

    mesh = getattr(model, "device_mesh", None)
    if data_parallel_size(mesh) > 1 or tensor_parallel_size(mesh) > 1 or getattr(model, "cp_size", 1) > 1:
        return False
    return not any(getattr(layer, "_compiled_call_impl", None) is not None for layer in language_layers(model.hf_model))


class GradArena:
    """The gradients of `params` as views of one buffer per dtype and device.

    `attach` gives every parameter without a gradient a zeroed view of its slot; backward then adds
    into it in place. `release_untouched` puts `None` back where backward reached nothing, so the
    optimizer and the step rule see what they would have seen (a parameter without a gradient is
    not stepped)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params  # the list it was built for (a new list means new parameters)
        self.trained = [p for p in params if p.requires_grad]  # a frozen one never gets a gradient
        self.slots: list[torch.Tensor] = []
        buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for p in self.trained:
            key = (p.dtype, p.device)
            sizes[key] = sizes.get(key, 0) + p.numel()
        for key, n in sizes.items():
            buffers[key] = torch.zeros(n, dtype=key[0], device=key[1])
        offsets = dict.fromkeys(sizes, 0)
        for p in self.trained:
            key = (p.dtype, p.device)
            self.slots.append(buffers[key][offsets[key] : offsets[key] + p.numel()].view_as(p))
            offsets[key] += p.numel()
        self.touched: set[int] = set()
        self._fresh: list[torch.nn.Parameter] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._touch) for p in self.trained]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _touch(self, p: torch.Tensor) -> None:
        self.touched.add(id(p))

    def attach(self) -> None:
        self._fresh = []
        for p, slot in zip(self.trained, self.slots):
            if p.grad is None:
                p.grad = slot.zero_()
                self._fresh.append(p)

    def release_untouched(self) -> None:
        for p in self._fresh:
            if id(p) not in self.touched:
                p.grad = None
        self.touched.clear()
        self._fresh = []


def _arena(arenas: dict[str, GradArena], name: str, params: list[torch.nn.Parameter]) -> GradArena | None:
    if not params or any(isinstance(p, DTensor) for p in params):
        return None  # FSDP2 / tensor-parallel shards: their gradients are the sharding's business
    arena = arenas.get(name)
    if arena is None or arena.params is not params:  # first backward, or the parameter list changed
        if arena is not None:
            arena.close()
        arena = arenas[name] = GradArena(params)
    return arena


@contextmanager
def gradients_in_one_buffer(
    arenas: dict[str, GradArena], name: str, params: list[torch.nn.Parameter], module: torch.nn.Module | None
) -> Generator[None]:
    """A backward whose gradients for `params` (adapter `name`'s trainable parameters) accumulate into
    one buffer, kept in `arenas` (the engine's) from one step to the next. Under DDP the reducer owns
    the gradients, so nothing changes there."""
    arena = None if isinstance(module, torch.nn.parallel.DistributedDataParallel) else _arena(arenas, name, params)
    if arena is None:
        yield
        return
    arena.attach()
    try:
        yield
    finally:
        arena.release_untouched()
