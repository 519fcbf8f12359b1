"""API keys: one per tenant, `tml-` prefixed (the Tinker SDK refuses others), stored only as hashes.

A key's role is 'tenant' or 'operator': an operator key works as a tenant key (its name is its
tenant) and also opens the operator page (`/operator`), which shows every tenant's load."""

from __future__ import annotations

import builtins  # the stores have a `list` method, which shadows the builtin in class scope
import hashlib
import re
import secrets

from twinkle.serve.core.store import Store

PREFIX = "tml-"
TENANT, OPERATOR = "tenant", "operator"  # the roles
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, store: Store):
        self.table = store.keys

    def create(self, name: str, operator: bool = False) -> str:
        """A new key for tenant `name`; the key itself is shown once and never stored."""
        if not _NAME.match(name):
            raise ValueError(f"key name {name!r} must be 1-64 letters, digits, '_', '.', '-' (starting alnum)")
        if self.table.active(name):
            raise ValueError(f"a key named {name!r} already exists; revoke it first")
        key = PREFIX + secrets.token_urlsafe(32)
        self.table.add(name, hash_key(key), OPERATOR if operator else TENANT)
        return key

    def list(self) -> builtins.list[dict]:
        return self.table.list()

    def revoke(self, name: str) -> bool:
        return self.table.revoke(name)

    def tenant_for(self, key: str | None) -> str | None:
        """The tenant (key name) of a valid, unrevoked key; None otherwise."""
        if not key or not key.startswith(PREFIX):
            return None
        return self.table.tenant_for(hash_key(key))

    def is_operator(self, key: str | None) -> bool:
        return bool(key and key.startswith(PREFIX) and self.table.role_for(hash_key(key)) == OPERATOR)

    def count(self) -> int:
        return self.table.count_active()
