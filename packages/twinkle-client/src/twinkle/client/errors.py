"""Errors the client raises: the server's message, its HTTP status, and whose fault it was."""

from __future__ import annotations


class TwinkleAPIError(RuntimeError):
    def __init__(self, message: str, status: int | None = None, category: str | None = None):
        super().__init__(message)
        self.status, self.category = status, category


class TwinkleRequestFailed(TwinkleAPIError):
    """A future finished with an error: category 'user' (bad input) or 'server'."""
