"""The Patch extension point: a reversible change to a model.

    with model.apply_patch(GradientCheckpointing()):
        ...            # patched
    # reverted here

`apply_patch` also works without `with` (the patch then stays until `.revert()` on the handle).
A patch receives the TransformersModel and must leave it exactly as it found it on `revert`.
"""

from __future__ import annotations

from typing import ClassVar

from twinkle.registry import Registry


class Patch:
    aliases: ClassVar[tuple[str, ...]] = ()

    def apply(self, model) -> None:
        raise NotImplementedError

    def revert(self, model) -> None:
        raise NotImplementedError


class AppliedPatch:
    """Handle returned by `apply_patch`: a context manager whose exit reverts the patch (once)."""

    def __init__(self, patch: Patch, model):
        self.patch, self.model, self.active = patch, model, True

    def revert(self) -> None:
        if self.active:
            self.active = False
            self.patch.revert(self.model)

    def __enter__(self):
        return self.patch

    def __exit__(self, *exc):
        self.revert()
        return False


PATCHES: Registry[Patch] = Registry("patch", "twinkle.patch", Patch)
register_patch = PATCHES.register
