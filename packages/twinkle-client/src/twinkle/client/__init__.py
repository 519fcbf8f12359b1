"""twinkle.client: Twinkle's wire schema and native HTTP client (httpx + pydantic; no torch).

    from twinkle.client import init_twinkle_client
    from twinkle.client.model import TransformersModel
    init_twinkle_client(base_url="http://localhost:8000", api_key="tml-...")

Proxies carry the local classes' names (`twinkle.client.model.TransformersModel`,
`twinkle.client.sampler.Sampler`); every call returns a `Future` (`.result()` or `await`).
`init_tinker_client()` instead points the unmodified Tinker SDK at the server.
"""

from twinkle.client.errors import TwinkleAPIError, TwinkleRequestFailed
from twinkle.client.future import Future
from twinkle.client.http import TwinkleClient
from twinkle.client.session import get_client, init_tinker_client, init_twinkle_client

__all__ = [
    "Future",
    "TwinkleAPIError",
    "TwinkleClient",
    "TwinkleRequestFailed",
    "get_client",
    "init_tinker_client",
    "init_twinkle_client",
]
