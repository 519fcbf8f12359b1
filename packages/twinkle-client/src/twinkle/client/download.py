"""Fetch a checkpoint's zip archive from the server with a progress bar (on stderr, only when it is a
terminal: tqdm's `disable=None`)."""

from __future__ import annotations

import sys

from tqdm import tqdm

from twinkle.client.http import TwinkleClient, api_error
from twinkle.client.schema import PREFIX


def fetch_archive(client: TwinkleClient, path: str, file=None) -> bytes:
    """The bytes of `GET /checkpoints/archive?path=...`, read in chunks that advance a bar."""
    chunks = []
    with client.http.stream("GET", PREFIX + "/checkpoints/archive", params={"path": path}) as resp:
        if resp.status_code >= 400:
            resp.read()
            raise api_error(resp)
        total = int(resp.headers.get("Content-Length", 0)) or None
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            desc=path.rstrip("/").rsplit("/", 1)[-1],
            file=file or sys.stderr,
            disable=None,
        ) as bar:
            for chunk in resp.iter_bytes():
                chunks.append(chunk)
                bar.update(len(chunk))
    return b"".join(chunks)
