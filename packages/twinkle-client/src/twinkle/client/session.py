"""The process-wide client `init_twinkle_client` sets up, which proxies use unless given their own."""

from __future__ import annotations

import os

from twinkle.client.http import TwinkleClient

_CLIENT: TwinkleClient | None = None


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None, **kwargs) -> TwinkleClient:
    """Connect this process to a Twinkle server; `twinkle.client.model.TransformersModel(...)` and the
    other proxies then train there. Defaults: TWINKLE_BASE_URL / TWINKLE_API_KEY."""
    global _CLIENT
    if _CLIENT is not None:
        _CLIENT.close()
    _CLIENT = TwinkleClient(base_url, api_key, **kwargs)
    return _CLIENT


def set_client(client: TwinkleClient) -> TwinkleClient:
    """Make `client` (a TwinkleClient or a subclass) the one proxies use; the previous one is closed."""
    global _CLIENT
    if _CLIENT is not None and _CLIENT is not client:
        _CLIENT.close()
    _CLIENT = client
    return client


def get_client() -> TwinkleClient:
    if _CLIENT is None:
        if os.environ.get("TWINKLE_BASE_URL"):
            return init_twinkle_client()
        raise RuntimeError("no Twinkle server: call init_twinkle_client(base_url=..., api_key=...) first")
    return _CLIENT


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """Point the unmodified Tinker SDK (`pip install tinker`) at a Twinkle server: sets TINKER_BASE_URL
    and TINKER_API_KEY for this process (from the arguments, else TWINKLE_BASE_URL / TWINKLE_API_KEY)
    and returns what it set. Nothing is patched; with neither given nor set, nothing changes (the SDK
    reads its own TINKER_* settings, or the base_url / api_key a script passes to ServiceClient)."""
    base_url = base_url or os.environ.get("TWINKLE_BASE_URL")
    api_key = api_key or os.environ.get("TWINKLE_API_KEY")
    if api_key and not api_key.startswith("tml-"):
        raise ValueError("the Tinker SDK only accepts keys starting with 'tml-' (Twinkle's keys do)")
    env = {k: v for k, v in (("TINKER_BASE_URL", base_url and base_url.rstrip("/")), ("TINKER_API_KEY", api_key)) if v}
    os.environ.update(env)
    return env
