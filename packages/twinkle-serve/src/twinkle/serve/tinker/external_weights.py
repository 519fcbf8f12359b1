"""Download URLs for external-weights checkpoints (`tinker checkpoint download`), served by this server.

`GET .../external_weights_urls` answers one URL per file, signed with a key this process holds
(HMAC over path, file and expiry): the SDK fetches them with a plain GET and no API key, as it would
a cloud bucket's signed URLs. A URL dies at its expiry, with its checkpoint, or when the server
restarts (a new key); the SDK re-signs when needed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from datetime import UTC, datetime
from pathlib import Path

from twinkle.serve.errors import BadRequest, Forbidden, NotFound

URL_TTL_S = 3600
INTERNAL_FILES = {"twinkle_checkpoint.json"}  # the server's own record, not part of the export


class UrlSigner:
    """Opaque tokens that authorize GETs of one thing until an expiry: `base64(json).hmac` with a
    per-process key, carried in the URL path (the token is the credential; it names no id by itself)."""

    def __init__(self):
        self._key = secrets.token_bytes(32)

    def _mac(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()

    def token(self, subject: str, expires: int, file: str = "") -> str:
        payload = base64.urlsafe_b64encode(json.dumps([subject, file, expires]).encode()).decode().rstrip("=")
        return f"{payload}.{self._mac(payload)}"

    def open(self, token: str) -> tuple[str, str]:
        """-> (subject, file) of a valid, unexpired token; 403 otherwise."""
        payload, _, mac = token.partition(".")
        if not token.isascii() or not hmac.compare_digest(self._mac(payload), mac):
            raise Forbidden(
                "this download URL's signature is not valid (or the server restarted since it "
                "was issued): ask for a new URL"
            )
        subject, file, expires = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        if expires < time.time():
            raise Forbidden("this download URL has expired: ask for a new URL")
        return subject, file


class ExternalWeights:
    def __init__(self, svc, signer: UrlSigner):
        self.svc, self.signer = svc, signer

    def _files(self, ckpt) -> list[str]:
        folder = self.svc.checkpoints.folder(ckpt)
        return sorted(f.name for f in folder.iterdir() if f.is_file() and f.name not in INTERNAL_FILES)

    def urls(self, tenant: str, base_url: str, run_id: str, checkpoint_id: str) -> dict:
        path = f"tinker://{run_id}/{checkpoint_id}"
        ckpt = self.svc.checkpoints.readable(tenant, path, purpose="download")  # own, or published by another
        if ckpt.kind != "external":
            raise BadRequest(
                f"checkpoint {path} is {ckpt.kind} weights, not external weights: export it with "
                "save_weights_external (tinker checkpoint download does this for training checkpoints)"
            )
        urls, expires = {}, int(time.time()) + URL_TTL_S
        for name in self._files(ckpt):
            token = self.signer.token(path, expires, name)
            urls[name] = f"{base_url.rstrip('/')}/api/v1/checkpoint_files/{token}"
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    def file(self, token: str) -> tuple[Path, str]:
        """The file a signed URL names; 403 for a bad or expired signature, 404 once the checkpoint is gone."""
        path, file = self.signer.open(token)
        ckpt = self.svc.store.checkpoints.get(path)
        if ckpt is None or ckpt.kind != "external" or file not in self._files(ckpt):
            raise NotFound(f"{file} of checkpoint {path} no longer exists")
        return self.svc.checkpoints.folder(ckpt) / file, file
