"""`twinkle-server`: serve the Tinker-compatible API, or manage API keys.

    twinkle-server [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [--config FILE]
    twinkle-server keys create NAME [--data-dir DIR]    # prints a new tml- key (shown once)
    twinkle-server keys list [--data-dir DIR]
    twinkle-server keys revoke NAME [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinkle-server", description="Twinkle's multi-tenant training server "
                                "(Tinker-compatible API under /api/v1).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", default=None, help="SQLite database, keys and checkpoints "
                   "(default $TWINKLE_DATA_DIR or ~/.local/share/twinkle-server)")
    p.add_argument("--config", default=None, help="TOML/JSON/YAML server config (base models, limits, ray)")
    p.add_argument("--log-level", default="info")
    return p


def _keys_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinkle-server keys", description="Manage API keys (one per tenant).")
    sub = p.add_subparsers(dest="action", required=True)
    for action, helptext in (("create", "create a key for tenant NAME"), ("revoke", "revoke tenant NAME's key")):
        s = sub.add_parser(action, help=helptext)
        s.add_argument("name")
        s.add_argument("--data-dir", default=None)
    s = sub.add_parser("list", help="list keys (names only; keys are stored hashed)")
    s.add_argument("--data-dir", default=None)
    return p


def keys_main(argv: list[str]) -> int:
    from twinkle.serve.keys import KeyStore
    from twinkle.serve.server import default_data_dir
    from twinkle.serve.store import Store

    args = _keys_parser().parse_args(argv)
    store = Store(args.data_dir or default_data_dir())
    keys = KeyStore(store)
    try:
        if args.action == "create":
            print(keys.create(args.name))
        elif args.action == "list":
            for row in keys.list():
                state = "revoked" if row["revoked_at"] else "active"
                print(f"{row['name']}\t{state}\t{datetime.fromtimestamp(row['created_at']).isoformat(timespec='seconds')}")
        elif not keys.revoke(args.name):
            print(f"no active key named {args.name!r}", file=sys.stderr)
            return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "keys":
        return keys_main(argv[1:])
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from twinkle.serve import initialize

    try:
        initialize(mode="http", host=args.host, port=args.port, data_dir=args.data_dir, config=args.config,
                   log_level=args.log_level)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
