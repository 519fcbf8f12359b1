"""Fetch a checkpoint's zip archive from the server with a progress bar (on stderr, only when it is a
terminal: tqdm's `disable=None`)."""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

from tqdm import tqdm

from twinkle.client.errors import TwinkleAPIError
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


def download_checkpoint(client: TwinkleClient, path: str, out: str | Path) -> list[str]:
    """The checkpoint's PEFT folder, unpacked into `out`; returns the file names."""
    data = fetch_archive(client, path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        names = zf.namelist()
        for member in names:
            if "/" in member or member.startswith("."):  # a flat PEFT folder: refuse anything else
                raise TwinkleAPIError(f"unexpected archive member {member!r}")
            (out / member).write_bytes(zf.read(member))
    return sorted(names)
