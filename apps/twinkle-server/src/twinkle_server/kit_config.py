"""twinkle-kit's Ray-Serve-style server YAML (`applications:` of server / model / sampler / processor
apps, `http_options`, ...) read onto our ServeConfig, with every key we do not honour named and why.

What maps:
- `http_options.host` / `.port` -> where the server listens;
- each `import_path: model` app -> a served base model: `args.model_id` its name, the hub-free ids
  the server app lists (`supported_models`) and the app's route as aliases; `args.backend: transformers`
  is our multi-LoRA engine; a `device_group` of more than one rank becomes a Ray DeviceGroup the model
  runs on (`device_type` kept), one rank stays in the server process;
- the sampler app of the same model -> that model's sampler (on its own Ray group when it has ranks);
- `queue_config.rps_limit` / `.tps_limit` -> limits.requests_per_s / input_tokens_per_s;
- `adapter_config.adapter_timeout` -> adapter_idle_offload_s (an idle adapter leaves the device; ours
  keeps it in host memory instead of dropping it);
- `server_config.per_token_model_limit` -> limits.max_models (models per key).

Everything else (Ray Serve deployments and autoscaling, proxy placement, telemetry, persistence, the
processor app, vLLM engine arguments, Megatron backends) is listed with the reason it is not honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IGNORED_TOP = {
    "proxy_location": "Ray Serve's HTTP proxy placement: one uvicorn server here",
    "telemetry": "OpenTelemetry export: /metrics serves Prometheus text instead",
    "persistence": "state lives in the server's SQLite store under --data-dir",
}
IGNORED_APP = {
    "deployments": "Ray Serve replicas and autoscaling: one server process (Ray groups for the model)",
    "route_prefix": "routes are fixed: Tinker under /api/v1, native under /twinkle/v1",
}
IGNORED_MODEL_ARGS = {
    "max_length": "the context is the model's own; the server caps requests by its limits",
    "nproc_per_node": "ranks come from device_group",
    "device_mesh": "one data-parallel group per model: its ranks come from device_group",
}
IGNORED_SAMPLER_ARGS = {
    "engine_args": "the server picks and configures its sampling engine",
    "nproc_per_node": "ranks come from device_group",
    "device_mesh": "ranks come from device_group",
    "sampler_type": "the server picks its sampling engine",
}


def is_kit_config(data: Any) -> bool:
    return isinstance(data, dict) and "applications" in data


@dataclass
class Mapped:
    config: dict  # our ServeConfig, as a dict
    host: str | None = None
    port: int | None = None
    ignored: list[str] = field(default_factory=list)  # "key: why"


def _prefix(name: str) -> str:
    return name.split("://", 1)[1] if "://" in name else name


def _group(mapped: Mapped, where: str, group: dict | None) -> str | None:
    """A Ray group for a device_group of more than one rank; None keeps it in the server process."""
    if not group or int(group.get("ranks", 1)) <= 1:
        return None
    device = {"gpu": "cuda", "cuda": "cuda", "cpu": "cpu"}.get(str(group.get("device_type", "cpu")).lower())
    if device is None:
        mapped.ignored.append(f"{where}.device_group.device_type: {group['device_type']!r} is not cpu or cuda")
        device = "cpu"
    ray = mapped.config.setdefault("ray", {"groups": []})
    name = f"{group.get('name', 'group')}-{len(ray['groups'])}"
    ray["groups"].append({"name": name, "ranks": int(group["ranks"]), "device_type": device})
    return name


def _limits(mapped: Mapped, where: str, queue: dict | None) -> None:
    for theirs, ours in (("rps_limit", "requests_per_s"), ("tps_limit", "input_tokens_per_s")):
        if queue and theirs in queue:
            mapped.config.setdefault("limits", {})[ours] = float(queue[theirs])
    for key in sorted(set(queue or {}) - {"rps_limit", "tps_limit"}):
        mapped.ignored.append(f"{where}.queue_config.{key}: not a limit this server has")


def _model_app(mapped: Mapped, where: str, args: dict, listed: list[str], models: dict[str, dict]) -> None:
    if args.get("backend", "transformers") != "transformers":
        mapped.ignored.append(f"{where}.args.backend: {args['backend']!r} (only transformers is served here)")
        return
    name = args["model_id"]
    # what clients may send for it: the hub-free id (twinkle-kit's clients strip the prefix)
    aliases = sorted(({m for m in listed if _prefix(m) == _prefix(name)} | {_prefix(name)}) - {name})
    entry: dict[str, Any] = {"name": name, "aliases": aliases}
    group = _group(mapped, where, args.get("device_group"))
    if group:
        entry["remote_group"] = group
    models[_prefix(name)] = entry
    mapped.config["models"].append(entry)
    _limits(mapped, where, args.get("queue_config"))
    timeout = (args.get("adapter_config") or {}).get("adapter_timeout")
    if timeout is not None:
        mapped.config["adapter_idle_offload_s"] = float(timeout)
    for key in sorted(set(args) & set(IGNORED_MODEL_ARGS)):
        mapped.ignored.append(f"{where}.args.{key}: {IGNORED_MODEL_ARGS[key]}")


def _sampler_app(mapped: Mapped, where: str, args: dict, models: dict[str, dict]) -> None:
    target = models.get(_prefix(args.get("model_id", "")))
    if target is None:
        mapped.ignored.append(f"{where}: samples a model no model app serves ({args.get('model_id')!r})")
        return
    group = _group(mapped, where, args.get("device_group"))
    if group:
        target["sampler_remote_group"] = group
    for key in sorted(set(args) & set(IGNORED_SAMPLER_ARGS)):
        mapped.ignored.append(f"{where}.args.{key}: {IGNORED_SAMPLER_ARGS[key]}")


def from_kit_yaml(data: dict) -> Mapped:
    mapped = Mapped(config={"models": []})
    http = data.get("http_options") or {}
    mapped.host, mapped.port = http.get("host"), http.get("port")
    for key in sorted(set(data) - {"applications", "http_options"}):
        mapped.ignored.append(f"{key}: {IGNORED_TOP.get(key, 'not a setting of this server')}")
    apps = data.get("applications") or []
    listed = [
        m for app in apps if app.get("import_path") == "server" for m in app.get("args", {}).get("supported_models", [])
    ]
    models: dict[str, dict] = {}
    for i, app in enumerate(apps):
        where, args, kind = f"applications[{i}] ({app.get('name')})", app.get("args") or {}, app.get("import_path")
        for key in sorted(set(app) & set(IGNORED_APP)):
            mapped.ignored.append(f"{where}.{key}: {IGNORED_APP[key]}")
        if kind == "server":
            limit = (args.get("server_config") or {}).get("per_token_model_limit")
            if limit is not None:
                mapped.config.setdefault("limits", {})["max_models"] = int(limit)
        elif kind == "model":
            _model_app(mapped, where, args, listed, models)
        elif kind == "sampler":
            _sampler_app(mapped, where, args, models)
        elif kind == "processor":
            mapped.ignored.append(f"{where}: datasets are built on the client (twinkle_client.dataset), not here")
        else:
            mapped.ignored.append(f"{where}.import_path: {kind!r} is not an app this server has")
    if not mapped.config["models"]:
        raise ValueError("the config serves no model: it needs an `import_path: model` app with args.model_id")
    return mapped
