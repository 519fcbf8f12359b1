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


def get_client() -> TwinkleClient:
    if _CLIENT is None:
        if os.environ.get("TWINKLE_BASE_URL"):
            return init_twinkle_client()
        raise RuntimeError("no Twinkle server: call init_twinkle_client(base_url=..., api_key=...) first")
    return _CLIENT


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """Point the unmodified Tinker SDK (`pip install tinker`) at a Twinkle server: sets TINKER_BASE_URL
    and TINKER_API_KEY for this process and returns them. Nothing is patched."""
    base_url = base_url or os.environ.get("TWINKLE_BASE_URL")
    api_key = api_key or os.environ.get("TWINKLE_API_KEY")
    if not base_url or not api_key:
        raise ValueError("init_tinker_client needs base_url and api_key (or TWINKLE_BASE_URL / TWINKLE_API_KEY)")
    if not api_key.startswith("tml-"):
        raise ValueError("the Tinker SDK only accepts keys starting with 'tml-' (Twinkle's keys do)")
    env = {"TINKER_BASE_URL": base_url.rstrip("/"), "TINKER_API_KEY": api_key}
    os.environ.update(env)
    return env
