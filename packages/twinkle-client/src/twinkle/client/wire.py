"""Keep-alive HTTP/1.1 connections to one server for the client's synchronous calls, one per thread.

The stdlib's `http.client` costs a fraction of httpx's CPU per call (httpx rebuilds and re-parses
URLs, cookies and header models on every request): ~0.2 ms against ~1.5 ms on these CPUs. A
training loop makes two or three calls per step, and on a small machine the client's CPU is taken
from the server computing the steps, so the hot path uses this; streaming downloads and the async
path keep httpx. Transport failures are raised as httpx's own error types, so callers catch one kind.
"""

from __future__ import annotations

import http.client
import json
import threading
from urllib.parse import urlencode, urlsplit

import httpx

# A reused connection the server has closed while idle fails on its first use; that is no lost request.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError, ConnectionAbortedError)


class Answer:
    """What the server answered: status, headers (case-insensitive) and the body."""

    def __init__(self, method: str, path: str, status: int, headers, body: bytes):
        self.method, self.path, self.status_code, self.headers, self.content = method, path, status, headers, body

    def json(self):
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class Wire:
    def __init__(self, base_url: str, headers: dict, timeout: float, connect_timeout: float):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url {base_url!r} is not an http(s) URL")
        self._https, self._host, self._port = url.scheme == "https", url.hostname, url.port
        self._prefix = url.path.rstrip("/")
        self._headers, self._timeout, self._connect_timeout = headers, timeout, connect_timeout
        self._local = threading.local()

    def _connection(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            conn = self._local.conn = cls(self._host, self._port, timeout=self._connect_timeout)
        return conn

    def _drop(self) -> None:
        conn, self._local.conn = getattr(self._local, "conn", None), None
        if conn is not None:
            conn.close()

    def send(
        self,
        method: str,
        path: str,
        json_body=None,
        params: dict | None = None,
        headers: dict | None = None,
        timeout: float | None = None,
    ) -> Answer:
        query = {k: str(v).lower() if isinstance(v, bool) else v for k, v in (params or {}).items()}
        target = self._prefix + path + (f"?{urlencode(query)}" if query else "")
        body = None if json_body is None else json.dumps(json_body, separators=(",", ":")).encode()
        sent = {**self._headers, **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/json"
        for fresh in (False, True):
            reused = getattr(self._local, "conn", None) is not None
            conn = self._connection()
            try:
                if conn.sock is None:
                    conn.connect()
                conn.sock.settimeout(timeout if timeout is not None else self._timeout)
                conn.request(method, target, body=body, headers=sent)
                resp = conn.getresponse()
                data = resp.read()
            except _STALE as e:
                self._drop()
                if reused and not fresh:
                    continue  # the idle connection was closed by the server: once more on a new one
                raise httpx.RemoteProtocolError(f"{method} {target}: {e}") from e
            except TimeoutError as e:
                self._drop()
                raise httpx.ReadTimeout(f"{method} {target}: no answer within the timeout") from e
            except (OSError, http.client.HTTPException) as e:
                self._drop()
                raise httpx.ConnectError(f"{method} {target}: {e}") from e
            if resp.will_close:
                self._drop()
            return Answer(method, target, resp.status, resp.headers, data)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._drop()
