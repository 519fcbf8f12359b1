"""Patches shipped with Twinkle: activation checkpointing and chunked cross-entropy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from twinkle.patch.base import Patch, register_patch

if TYPE_CHECKING:
    from twinkle.patch.base import PatchTarget


@register_patch
class GradientCheckpointing(Patch):
    """Recompute each decoder layer's activations in backward instead of keeping them.

    A model trained in one process, not compiled, uses the reentrant checkpoint: the layer's forward
    builds no autograd graph, so nothing small outlives the activations around it and fragments the
    heap (`twinkle.model.compact_heap`; transformers makes the embedding's output require grad, so it
    works with a frozen embedding under LoRA); data/tensor/context-parallel and compiled models keep
    the non-reentrant one. transformers recomputes only in training mode, which `forward_backward`
    runs in (evaluation keeps nothing to recompute). Reverting restores the previous setting."""

    aliases = ("gradient_checkpointing",)

    def apply(self, model: PatchTarget) -> None:
        from twinkle.model.compact_heap import reentrant_checkpointing_fits

        hf = model.hf_model
        kwargs = {"use_reentrant": reentrant_checkpointing_fits(model)}
        # transformers 5 renamed the methods and the flag and warns on the old names; older releases have only those
        if hasattr(type(hf), "activation_checkpointing_enable"):
            self._was_on = bool(hf.is_activation_checkpointing)
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            self._was_on = bool(getattr(hf, "is_gradient_checkpointing", False))
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        hf.config.use_cache = False

    def revert(self, model: PatchTarget) -> None:
        if self._was_on:
            return
        hf = model.hf_model
        if hasattr(type(hf), "activation_checkpointing_disable"):
            hf.activation_checkpointing_disable()
        else:
            hf.gradient_checkpointing_disable()


@register_patch
class ChunkedCrossEntropy(Patch):
    """Compute the output projection and every token-level loss quantity `chunk_size` positions at
    a time (`twinkle.loss.ChunkedHead`), so the [batch, seq, vocab] logits tensor never exists:
    peak memory for the head falls from B·T·V to chunk_size·V floats. TransformersModel already
    does this by default once a pass's logits would pass `twinkle.loss.LOGITS_BUDGET_BYTES`; the
    patch forces it for every pass and sets the chunk size."""

    aliases = ("chunked_cross_entropy", "chunked_ce")

    def __init__(self, chunk_size: int = 1024) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size

    def apply(self, model: PatchTarget) -> None:
        from twinkle.model.output_projection import check_chunkable

        check_chunkable(model.hf_model)
        self._previous = model.head_chunk_size
        model.head_chunk_size = self.chunk_size

    def revert(self, model: PatchTarget) -> None:
        model.head_chunk_size = self._previous
