"""`twinkle-server`: serve the Tinker-compatible and native APIs, or manage API keys.

twinkle-server [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [--config FILE] [--model NAME]... [--log-level info]
twinkle-server keys create NAME [--operator] [--data-dir DIR]  # prints a new tml- key (shown once)
twinkle-server keys list [--data-dir DIR]
twinkle-server keys revoke NAME [--data-dir DIR]
twinkle-server keys usage [NAME] [--json]           # tokens trained/sampled, checkpoint bytes, per run
twinkle-server keys set-quota NAME [--tokens-per-day N] [--storage-bytes N] [--adapters N]  # "none" clears
twinkle-server launch -c server_config.yaml [--data-dir DIR]   # ours, or twinkle-kit's Ray-Serve-style YAML
twinkle-server check-config -c server_config.yaml               # what it maps to, and each key not honoured
twinkle-server print-config -c server_config.yaml               # the resulting config, as JSON
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # what both logging and uvicorn accept
DATA_DIR_HELP = "SQLite database, keys and checkpoints (default $TWINKLE_DATA_DIR or ~/.local/share/twinkle-server)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="twinkle-server",
        description="Twinkle's multi-tenant training server "
        "(Tinker-compatible API under /api/v1, native API under /twinkle/v1). "
        "With no command it serves.",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    p.add_argument("--config", default=None, help="TOML/JSON/YAML server config (base models, limits, ray)")
    p.add_argument(
        "--model",
        action="append",
        default=None,
        metavar="NAME",
        help="a base model to serve (hub id, local folder or twinkle://...); repeat for several. "
        "Replaces the config file's [[models]] (default: twinkle://qwen3-demo)",
    )
    p.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    commands = p.add_subparsers(dest="command", title="commands", metavar="{keys,launch,check-config,print-config}")
    for name, helptext in (
        ("launch", "serve the config file's models (ours, or twinkle-kit's server YAML)"),
        ("check-config", "validate a config file: what it maps to and each key not honoured"),
        ("print-config", "print the config a file gives, as JSON"),
    ):
        s = commands.add_parser(name, help=helptext, description=helptext)
        s.add_argument("-c", "--config", required=True, help="TOML/JSON/YAML file: ours or twinkle-kit's")
        s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    keys = commands.add_parser(
        "keys", help="manage API keys (one per tenant)", description="Manage API keys (one per tenant)."
    )
    actions = keys.add_subparsers(dest="action", required=True)
    for action, helptext in (
        ("create", "create a key for tenant NAME (printed once)"),
        ("revoke", "revoke tenant NAME's key"),
    ):
        s = actions.add_parser(action, help=helptext)
        s.add_argument("name")
        s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
        if action == "create":
            s.add_argument(
                "--operator", action="store_true", help="an operator key: also opens /operator (every tenant's load)"
            )
    s = actions.add_parser("list", help="list keys (names only; keys are stored hashed)")
    s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)  # or before `keys`
    s = actions.add_parser("usage", help="tokens trained and sampled, checkpoint bytes and quotas, per key and run")
    s.add_argument("name", nargs="?", help="one key (default: every key)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    s = actions.add_parser("set-quota", help="set a key's quotas (refused with 429/409 past them; 'none' clears)")
    s.add_argument("name")
    for flag in ("--tokens-per-day", "--storage-bytes", "--adapters"):
        s.add_argument(flag, type=_quota, default=argparse.SUPPRESS, metavar="N|none")
    s.add_argument("--data-dir", default=argparse.SUPPRESS, help=DATA_DIR_HELP)
    return p


def _quota(text: str) -> int | None:
    if text.lower() == "none":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a quota is a whole number >= 0 or 'none', got {text!r}")
    return int(text)


def _usage_text(report: dict) -> str:
    t, q = report["tokens"], report["quotas"]
    limits = ", ".join(f"{k} {'-' if v is None else v}" for k, v in q.items())
    lines = [
        f"{report['tenant']}: trained {t['training']} tokens, sampled {t['sampling_prefill']} prompt + "
        f"{t['sampling_sample']} sampled tokens, {report['tokens_today']} tokens today, "
        f"checkpoints {report['checkpoint_bytes']} bytes; quotas: {limits}"
    ]
    lines += [
        f"  {r['model_id']} ({r['api']}): trained {r['training']}, sampled {r['sampling']} tokens, "
        f"checkpoints {r['checkpoint_bytes']} bytes"
        for r in report["runs"]
    ]
    return "\n".join(lines)


def _keys_report(store, keys, args) -> int:
    from twinkle.serve.core.usage import UsageLedger

    names = [args.name] if args.name else [row["name"] for row in keys.list() if not row["revoked_at"]]
    if args.name and not store.keys.active(args.name):
        print(f"no active key named {args.name!r}", file=sys.stderr)
        return 1
    reports = [UsageLedger(store).report(name) for name in names]
    print(json.dumps(reports, indent=2) if args.json else "\n".join(_usage_text(r) for r in reports))
    return 0


def _set_quota(store, args) -> int:
    if not store.keys.active(args.name):
        print(f"no active key named {args.name!r}", file=sys.stderr)
        return 1
    changes = {k: getattr(args, k) for k in store.quotas.FIELDS if hasattr(args, k)}
    if not changes:
        print("nothing to set: pass --tokens-per-day, --storage-bytes and/or --adapters", file=sys.stderr)
        return 2
    quotas = store.quotas.set(args.name, **changes)
    print(f"{args.name}: " + ", ".join(f"{k} {'-' if v is None else v}" for k, v in quotas.items()))
    return 0


def keys_main(args: argparse.Namespace) -> int:
    from twinkle.serve.core.store import Store, default_data_dir
    from twinkle.serve.keys import KeyStore

    store = Store(args.data_dir or default_data_dir())
    keys = KeyStore(store)
    try:
        if args.action == "create":
            print(keys.create(args.name, operator=args.operator))
        elif args.action == "usage":
            return _keys_report(store, keys, args)
        elif args.action == "set-quota":
            return _set_quota(store, args)
        elif args.action == "list":
            for row in keys.list():
                state = "revoked" if row["revoked_at"] else "active"
                created = datetime.fromtimestamp(row["created_at"]).isoformat(timespec="seconds")
                print(f"{row['name']}\t{state}\t{created}" + ("\toperator" if row["role"] == "operator" else ""))
        elif not keys.revoke(args.name):
            print(f"no active key named {args.name!r}", file=sys.stderr)
            return 1
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    return 0


def _config_file(path: str):
    """(ServeConfig, host, port, keys not honoured) from our config file or twinkle-kit's YAML."""
    from twinkle.serve import ServeConfig
    from twinkle.serve.config import load_config, read_config_file
    from twinkle_server.kit_config import from_kit_yaml, is_kit_config

    data = read_config_file(path)
    if not is_kit_config(data):
        return load_config(path), None, None, []
    mapped = from_kit_yaml(data)
    return ServeConfig.model_validate(mapped.config), mapped.host, mapped.port, mapped.ignored


def config_main(args: argparse.Namespace) -> int:
    try:
        config, host, port, ignored = _config_file(args.config)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {args.config}: {e}", file=sys.stderr)
        return 2
    if args.command == "print-config":
        print(json.dumps({"host": host, "port": port, **config.model_dump(exclude_defaults=True)}, indent=2))
        return 0
    if args.command == "check-config":
        print(
            f"{args.config}: serves {', '.join(m.name for m in config.models)}" + (f" on {host}:{port}" if port else "")
        )
        for line in ignored:
            print(f"  not honoured: {line}")
        return 0
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in ignored:
        logging.getLogger("twinkle_server").warning("config key not honoured: %s", line)
    from twinkle.serve import initialize

    initialize(
        mode="http",
        host=host or args.host,
        port=args.port if port is None else int(port),
        data_dir=args.data_dir,
        config=config,
        log_level=args.log_level,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "keys":
        return keys_main(args)
    if args.command in ("launch", "check-config", "print-config"):
        return config_main(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from twinkle.serve import ServeConfig, initialize, load_config

    try:
        config = load_config(args.config)
        if args.model:  # the command line wins over the file, as with every other flag
            models = [{"name": name} for name in args.model]
            config = ServeConfig.model_validate({**config.model_dump(exclude={"models"}), "models": models})
        initialize(
            mode="http",
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            config=config,
            log_level=args.log_level,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
