"""The Patch extension point: a reversible change to a model.

    with model.apply_patch(GradientCheckpointing()):
        ...            # patched
    # reverted here

`apply_patch` also works without `with` (the patch then stays until `.revert()` on the handle).
A patch receives the TransformersModel and must leave it exactly as it found it on `revert`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal, Protocol

from twinkle.registry import Registry

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class PatchTarget(Protocol):
    """What a patch reads and sets on the model it patches (TransformersModel has it; named so
    structurally, as the model's module imports this one)."""

    head_chunk_size: int | None

    @property
    def hf_model(self) -> PreTrainedModel: ...


class Patch:
    aliases: ClassVar[tuple[str, ...]] = ()

    def apply(self, model: PatchTarget) -> None:
        raise NotImplementedError

    def revert(self, model: PatchTarget) -> None:
        raise NotImplementedError


class AppliedPatch:
    """Handle returned by `apply_patch`: a context manager whose exit reverts the patch (once)."""

    def __init__(self, patch: Patch, model: PatchTarget) -> None:
        self.patch, self.model, self.active = patch, model, True

    def revert(self) -> None:
        if self.active:
            self.active = False
            self.patch.revert(self.model)

    def __enter__(self) -> Patch:
        return self.patch

    def __exit__(self, *exc: object) -> Literal[False]:
        self.revert()
        return False


PATCHES: Registry[Patch] = Registry("patch", "twinkle.patch", Patch)
register_patch = PATCHES.register
