"""The OpenAI-compatible API: chat and text completions (SSE streaming) over a tenant's trained adapters."""

from twinkle.serve.openai.routes import build_openai_router

__all__ = ["build_openai_router"]
