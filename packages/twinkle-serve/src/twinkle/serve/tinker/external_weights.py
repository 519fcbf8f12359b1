"""Download URLs for external-weights checkpoints (`tinker checkpoint download`), served by this server.

`GET .../external_weights_urls` answers one URL per file, signed with a key this process holds
(HMAC over path, file and expiry): the SDK fetches them with a plain GET and no API key, as it would
a cloud bucket's signed URLs. A URL dies at its expiry, with its checkpoint, or when the server
restarts (a new key); the SDK re-signs when needed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlencode

from twinkle.serve.errors import ApiError, BadRequest, NotFound

URL_TTL_S = 3600
INTERNAL_FILES = {"twinkle_checkpoint.json"}  # the server's own record, not part of the export


class Forbidden(ApiError):
    status = 403


class UrlSigner:
    """Query strings that authorize one GET of one thing until an expiry (HMAC with a per-process key)."""

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def _sign(self, subject: str, file: str, expires: int) -> str:
        return hmac.new(self._key, f"{subject}\n{file}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def query(self, subject_field: str, subject: str, expires: int, file: str = "") -> str:
        fields = {subject_field: subject, **({"file": file} if file else {}), "expires": expires,
                  "sig": self._sign(subject, file, expires)}
        return urlencode(fields)

    def check(self, subject: str, file: str, expires: str, sig: str) -> None:
        if not expires.isdigit() or not hmac.compare_digest(self._sign(subject, file, int(expires)), sig):
            raise Forbidden("this download URL's signature is not valid (or the server restarted since it "
                            "was issued): ask for a new URL")
        if int(expires) < time.time():
            raise Forbidden("this download URL has expired: ask for a new URL")


class ExternalWeights:
    def __init__(self, rt, training, signer: UrlSigner):
        self.rt, self.training, self.signer = rt, training, signer

    @staticmethod
    def _files(row: dict) -> list[str]:
        folder = Path(row["dir"])
        return sorted(f.name for f in folder.iterdir() if f.is_file() and f.name not in INTERNAL_FILES)

    def urls(self, tenant: str, base_url: str, run_id: str, checkpoint_id: str) -> dict:
        path = f"tinker://{run_id}/{checkpoint_id}"
        row = self.training.readable_checkpoint(tenant, path)  # own, or published by another tenant
        if row["kind"] != "external":
            raise BadRequest(f"checkpoint {path} is {row['kind']} weights, not external weights: export it with "
                             "save_weights_external (tinker checkpoint download does this for training checkpoints)")
        urls, expires = {}, int(time.time()) + URL_TTL_S
        for name in self._files(row):
            query = self.signer.query("path", path, expires, name)
            urls[name] = f"{base_url.rstrip('/')}/api/v1/checkpoint_files?{query}"
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}

    def file(self, path: str, file: str, expires: str, sig: str) -> Path:
        """The file a signed URL names; 403 for a bad or expired signature, 404 once the checkpoint is gone."""
        self.signer.check(path, file, expires, sig)
        row = self.rt.store.one("SELECT dir FROM checkpoints WHERE tinker_path=? AND kind='external'", (path,))
        if row is None or file not in self._files(row):
            raise NotFound(f"{file} of checkpoint {path} no longer exists")
        return Path(os.path.join(row["dir"], file))
