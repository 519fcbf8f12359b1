"""twinkle.patch: reversible model patches (entry-point group `twinkle.patch`)."""

from twinkle.patch.base import PATCHES, AppliedPatch, Patch, register_patch
from twinkle.patch.builtin import ChunkedCrossEntropy, GradientCheckpointing

__all__ = ["PATCHES", "AppliedPatch", "ChunkedCrossEntropy", "GradientCheckpointing", "Patch", "register_patch"]
