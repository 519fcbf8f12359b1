"""The HTTP session to one Twinkle server: API key, retries, sync and async.

Synchronous calls go over keep-alive `http.client` connections (`wire.py` says why); the async path and
streamed downloads use httpx.

Retries: a 429/503 (nothing was accepted) after its Retry-After; a lost connection or a timed-out
answer a few times with backoff. Every non-GET call carries one X-Idempotency-Key for all its
attempts, so a submission whose answer was lost on the wire runs once on the server.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import httpx

from twinkle.client.errors import TwinkleAPIError
from twinkle.client.schema import PREFIX
from twinkle.client.wire import Wire

RETRY_STATUSES = (429, 503)
TRANSPORT_RETRIES = 3  # lost connections / timeouts; then the error reaches the caller


def _with_key(method: str, headers: dict | None) -> dict | None:
    if method.upper() == "GET":
        return headers
    return {"X-Idempotency-Key": uuid.uuid4().hex, **(headers or {})}


def _retryable(resp) -> bool:
    """429/503 are retried after their Retry-After, except a 429 naming a quota (tokens per day): it
    lasts until the day ends, so the caller hears of it now."""
    if resp.status_code not in RETRY_STATUSES:
        return False
    try:
        return "quota" not in resp.json()
    except ValueError:
        return True


def _backoff(attempt: int) -> float:
    return 0.5 * 2**attempt


def api_error(resp, method: str | None = None, path: str | None = None) -> TwinkleAPIError:
    """A TwinkleAPIError from an httpx.Response or a wire Answer (then with its method and path)."""
    try:
        body = resp.json()
        message = body.get("error") or body.get("detail") or resp.text
        if isinstance(message, list):  # FastAPI validation errors: say which field is wrong
            message = "; ".join(f"{'.'.join(map(str, e.get('loc', [])))}: {e.get('msg')}" for e in message)
        category = body.get("category")
    except ValueError:
        message, category = resp.text, None
    method = method or resp.request.method
    path = path or resp.request.url.path
    return TwinkleAPIError(f"{method} {path} -> {resp.status_code}: {message}", resp.status_code, category)


class TwinkleClient:
    def __init__(
        self, base_url: str | None = None, api_key: str | None = None, timeout: float = 60.0, max_retries: int = 30
    ):
        base_url = base_url or os.environ.get("TWINKLE_BASE_URL")
        api_key = api_key or os.environ.get("TWINKLE_API_KEY")
        if not base_url:
            raise ValueError("no server: pass base_url= or set TWINKLE_BASE_URL")
        if not api_key:
            raise ValueError(
                "no API key: pass api_key= or set TWINKLE_API_KEY (create one with `twinkle-server keys create NAME`)"
            )
        self.base_url, self.api_key, self.max_retries = base_url.rstrip("/"), api_key, max_retries
        self._headers = {"X-API-Key": api_key}
        self._timeout = httpx.Timeout(timeout, connect=10.0)
        self.http = httpx.Client(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
        self.wire = Wire(self.base_url, self._headers, timeout, connect_timeout=10.0)
        self._async: httpx.AsyncClient | None = None

    # ---- sync ----------------------------------------------------------------------------------
    def request(
        self,
        method: str,
        path: str,
        json=None,
        params=None,
        headers=None,
        raw: bool = False,
        timeout: float | None = None,
    ):
        url = path if path.startswith(PREFIX) else PREFIX + path
        headers, lost = _with_key(method, headers), 0
        for attempt in range(self.max_retries + TRANSPORT_RETRIES + 1):  # room for both kinds: ends in return or raise
            try:
                resp = self.wire.send(method, url, json, params, headers, timeout)
            except httpx.TransportError:
                if lost >= TRANSPORT_RETRIES:
                    raise
                time.sleep(_backoff(lost))
                lost += 1
                continue
            if attempt < self.max_retries and _retryable(resp):
                time.sleep(float(resp.headers.get("retry-after", "1")))
                continue
            if resp.status_code >= 400:
                raise api_error(resp, method, url)
            return resp.content if raw else resp.json()
        raise AssertionError("unreachable")

    def get(self, path: str, **params):
        # a long poll (`timeout=` seconds on the server) may hold the answer that long: read for longer
        wait = params.get("timeout")
        return self.request(
            "GET",
            path,
            params={k: v for k, v in params.items() if v is not None},
            timeout=None if wait is None else max(self._timeout.read or 0, wait + 30),
        )

    def post(self, path: str, body=None, seq: int | None = None):
        headers = {"X-Twinkle-Seq": str(seq)} if seq is not None else None
        return self.request("POST", path, json=body, headers=headers)

    def import_adapter(self, folder, base_model: str, name: str | None = None) -> str:
        """Upload a local PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) as a
        training checkpoint; -> its tinker:// path, to `load` into a model (or pass to the Tinker SDK's
        `create_training_client_from_state`) and train on from those weights. The server checks rank
        and target modules against `base_model` and answers a 400 naming what does not fit."""
        import base64
        from pathlib import Path

        folder = Path(folder)
        files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in folder.iterdir() if p.is_file()}
        files.pop("README.md", None)  # peft's save_pretrained writes a model card beside the adapter
        body = {"base_model": base_model, "name": name or folder.name, "files": files}
        return self.post("/adapters/import", body)["path"]

    # ---- async ---------------------------------------------------------------------------------
    async def arequest(self, method: str, path: str, json=None, params=None):
        if self._async is None:
            self._async = httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self._timeout)
        headers, lost = _with_key(method, None), 0
        for attempt in range(self.max_retries + TRANSPORT_RETRIES + 1):  # room for both kinds: ends in return or raise
            try:
                resp = await self._async.request(method, PREFIX + path, json=json, params=params, headers=headers)
            except httpx.TransportError:
                if lost >= TRANSPORT_RETRIES:
                    raise
                await asyncio.sleep(_backoff(lost))
                lost += 1
                continue
            if attempt < self.max_retries and _retryable(resp):
                await asyncio.sleep(float(resp.headers.get("retry-after", "1")))
                continue
            if resp.status_code >= 400:
                raise api_error(resp)
            return resp.json()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.wire.close()
        self.http.close()

    def __repr__(self) -> str:
        return f"TwinkleClient({self.base_url!r})"
