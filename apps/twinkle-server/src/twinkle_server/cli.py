"""`twinkle-server`: serve the Tinker-compatible and native APIs, or manage API keys.

    twinkle-server [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [--config FILE] [--log-level info]
    twinkle-server keys create NAME [--data-dir DIR]    # prints a new tml- key (shown once)
    twinkle-server keys list [--data-dir DIR]
    twinkle-server keys revoke NAME [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
from datetime import datetime

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # what both logging and uvicorn accept
DATA_DIR_HELP = "SQLite database, keys and checkpoints (default $TWINKLE_DATA_DIR or ~/.local/share/twinkle-server)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinkle-server", description="Twinkle's multi-tenant training server "
                                "(Tinker-compatible API under /api/v1, native API under /twinkle/v1). "
                                "With no command it serves.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--config", default=None, help="TOML/JSON/YAML server config (base models, limits, ray)")
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    commands = p.add_subparsers(dest="command", title="commands", metavar="{keys}")
    keys = commands.add_parser("keys", help="manage API keys (one per tenant)",
                               description="Manage API keys (one per tenant).")
    actions = keys.add_subparsers(dest="action", required=True)
    for action, helptext in (("create", "create a key for tenant NAME (printed once)"),
                             ("revoke", "revoke tenant NAME's key")):
        s = actions.add_parser(action, help=helptext)
        s.add_argument("name")
        s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    s = actions.add_parser("list", help="list keys (names only; keys are stored hashed)")
    s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)  # or before `keys`
    return p


def keys_main(args: argparse.Namespace) -> int:
    from twinkle.serve.keys import KeyStore
    from twinkle.serve.server import default_data_dir
    from twinkle.serve.core.store import Store

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
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "keys":
        return keys_main(args)
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
