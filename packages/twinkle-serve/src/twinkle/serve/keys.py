"""API keys: one per tenant, `tml-` prefixed (the Tinker SDK refuses others), stored only as hashes."""

from __future__ import annotations

import hashlib
import re
import secrets
import time

from twinkle.serve.store import Store

PREFIX = "tml-"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, store: Store):
        self.store = store

    def create(self, name: str) -> str:
        """A new key for tenant `name`; the key itself is shown once and never stored."""
        if not _NAME.match(name):
            raise ValueError(f"key name {name!r} must be 1-64 letters, digits, '_', '.', '-' (starting alnum)")
        if self.store.one("SELECT name FROM api_keys WHERE name = ? AND revoked_at IS NULL", (name,)):
            raise ValueError(f"a key named {name!r} already exists; revoke it first")
        key = PREFIX + secrets.token_urlsafe(32)
        self.store.insert("api_keys", name=name, key_hash=hash_key(key), created_at=time.time(), revoked_at=None)
        return key

    def list(self) -> list[dict]:
        return self.store.all("SELECT name, created_at, revoked_at FROM api_keys ORDER BY created_at")

    def revoke(self, name: str) -> bool:
        return self.store.execute("UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                                  (time.time(), name)) > 0

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant (key name) of a valid, unrevoked key; None otherwise."""
        if not key or not key.startswith(PREFIX):
            return None
        row = self.store.one("SELECT name FROM api_keys WHERE key_hash = ? AND revoked_at IS NULL", (hash_key(key),))
        return row["name"] if row else None

    def count(self) -> int:
        return self.store.one("SELECT COUNT(*) AS n FROM api_keys WHERE revoked_at IS NULL")["n"]
