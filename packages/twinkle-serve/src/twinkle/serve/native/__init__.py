"""twinkle.serve.native: the native Twinkle HTTP API (a superset of Tinker's), mounted under /twinkle/v1."""

from twinkle.serve.native.routes import build_native_router

__all__ = ["build_native_router"]
