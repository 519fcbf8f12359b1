"""twinkle.serve.native: the native Twinkle HTTP API (a superset of Tinker's), mounted under /twinkle/v1."""

from twinkle.serve.native.routes import build_native_router
from twinkle.serve.native.service import NativeService

__all__ = ["NativeService", "build_native_router"]
