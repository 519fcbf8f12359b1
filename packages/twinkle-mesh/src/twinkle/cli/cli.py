"""`CLI.from_args()`: a script's settings from, in increasing precedence, the groups' defaults, a `.env`
file, the environment, a YAML file (`--config`) and command-line flags — twinkle-kit's sources.

Keys are case-insensitive and `-` / `_` alike: `--model-id`, `MODEL_ID`, `TWINKLE_MODEL_ID` and
`model_id:` in YAML all set `args.model.model_id`. A key names a field (the primary group's when two
groups share it), a field alias (`lr`), or `<group>_<field>`; YAML may also nest `group: {field: ...}`.
The environment is read for `TWINKLE_<KEY>` and bare `<KEY>` where the key names a field (other `TWINKLE_*`
variables, such as `TWINKLE_CACHE`, are settings of twinkle itself, not of the script). Strings are cast to
the field's type (a bad value is an error naming the key); a key no group has, from a YAML file or a
flag, lands in `args.extra`.
"""

from __future__ import annotations

import json
import os
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from twinkle.cli.args import Args

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _norm(key: str) -> str:
    return key.strip().lower().replace("-", "_")


def _field_index(args: Args) -> dict[str, tuple[str, str]]:
    """key -> (group, field) for every bare field name, alias and `<group>_<field>`."""
    index: dict[str, tuple[str, str]] = {}
    for group_name, group in args.groups().items():
        for f in fields(group):
            index[f"{group_name}_{f.name}"] = (group_name, f.name)
            for key in (f.name, *f.metadata.get("aliases", ())):
                if key not in index or f.metadata.get("primary"):
                    index[key] = (group_name, f.name)
    return index


def _cast(value: Any, annotation: Any, key: str) -> Any:
    """`value` (a string from argv / env, or a YAML value) as the field's type."""
    origin, params = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if isinstance(value, str) and value.lower() in ("none", "null", ""):
            return None
        if value is None:
            return None
        return _cast(value, next(p for p in params if p is not type(None)), key)
    if not isinstance(value, str):
        return value
    if origin is typing.Literal:
        if value not in params:
            raise ValueError(f"{key}={value!r}: expected one of {list(params)}")
        return value
    if annotation is bool:
        if value.lower() not in _TRUE | _FALSE:
            raise ValueError(f"{key}={value!r}: expected a boolean (true/false)")
        return value.lower() in _TRUE
    if annotation in (int, float):
        try:
            return annotation(value)
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected {annotation.__name__}") from None
    if origin in (list, dict):
        if value.strip().startswith(("[", "{")):
            return json.loads(value)
        if origin is list:
            return [v.strip() for v in value.split(",") if v.strip()]
        raise ValueError(f"{key}={value!r}: expected a JSON object")
    return value


def _apply(args: Args, source: dict[str, Any]) -> None:
    index, groups = _field_index(args), args.groups()
    for raw_key, value in source.items():
        key = _norm(raw_key)
        if key not in index and key.startswith("twinkle_"):
            key = key[len("twinkle_") :]
        if key in groups and isinstance(value, dict):  # YAML: a group given as a mapping
            _apply(args, {f"{key}_{k}": v for k, v in value.items()})
            continue
        if key not in index:
            args.extra[key] = value
            continue
        group_name, name = index[key]
        group = groups[group_name]
        annotation = typing.get_type_hints(type(group))[name]
        setattr(group, name, _cast(value, annotation, raw_key))


def dotenv_values(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a .env file (comments, blank lines and `export ` skipped; quotes removed)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip().removeprefix("export ").strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        out[key.strip()] = value
    return out


def _env_values(args: Args) -> dict[str, str]:
    index = _field_index(args)
    out = {}
    for key, value in os.environ.items():
        name = key[len("TWINKLE_") :] if key.startswith("TWINKLE_") else key
        if _norm(name) in index:
            out[name] = value
    return out


def argv_values(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value`, `--flag` (true) and `--no-flag` (false)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if not token.startswith("--"):
            raise ValueError(f"unexpected argument {token!r}: settings are --key value")
        key = token[2:]
        if "=" in key:
            name, _, value = key.partition("=")
            out[name] = value
            continue
        if key.startswith(("no-", "no_")):
            out[key[3:]] = "false"
        elif i < len(argv) and not argv[i].startswith("--"):
            out[key] = argv[i]
            i += 1
        else:
            out[key] = "true"
    return out


def yaml_values(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    try:
        import yaml
    except ImportError as e:
        raise ImportError("reading a YAML config needs pyyaml: pip install 'twinkle-mesh[yaml]'") from e
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config file holds a mapping of settings, got {type(data).__name__}")
    return data


class CLI:
    @staticmethod
    def from_args(
        argv: list[str] | None = None, env_file: str | Path | None = None, config_file: str | Path | None = None
    ) -> Args:
        args = Args()
        env_path = (
            Path(env_file)
            if env_file is not None
            else next((p for p in (Path(".env"), Path(".env.local")) if p.is_file()), None)
        )
        if env_path is not None and env_path.is_file():
            _apply(args, dotenv_values(env_path))
        _apply(args, _env_values(args))
        flags = argv_values(sys.argv[1:] if argv is None else list(argv))
        config = config_file or flags.pop("config", None)
        if config:
            _apply(args, yaml_values(config))
        _apply(args, flags)
        return args
