"""`twinkle`: the client's command line — runs, checkpoints, download a checkpoint as a PEFT folder,
server capacity and queue. Server and key from --base-url/--api-key or TWINKLE_BASE_URL/TWINKLE_API_KEY.

    twinkle runs
    twinkle checkpoints [--run MODEL_ID]
    twinkle download tinker://<model_id>/weights/<name> -o ./my-lora
    twinkle status
    twinkle upload ./my-lora hf://org/name        (or ms://org/name; needs no server)
    twinkle export --merge ./my-lora ./merged     (base + LoRA as one transformers folder; needs no server)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from twinkle.client.download import download_checkpoint
from twinkle.client.errors import TwinkleAPIError
from twinkle.client.http import TwinkleClient
from twinkle.client.hub_upload import upload_folder
from twinkle.client.schema import CheckpointList, RunList, ServerStatus


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) if ts else "-"


def _table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def cmd_runs(client: TwinkleClient, args) -> str:
    runs = RunList.model_validate(client.get("/runs", limit=args.limit)).runs
    if args.json:
        return json.dumps([r.model_dump() for r in runs], indent=2)
    return _table(
        [
            [
                r.model_id,
                r.name,
                r.api,
                r.base_model,
                r.lora_rank,
                r.steps,
                None if r.last_loss is None else f"{r.last_loss:.4f}",
                _when(r.last_request_time),
            ]
            for r in runs
        ],
        ["RUN", "NAME", "API", "BASE MODEL", "RANK", "STEPS", "LAST LOSS", "LAST REQUEST"],
    )


def cmd_checkpoints(client: TwinkleClient, args) -> str:
    ckpts = CheckpointList.model_validate(client.get("/checkpoints", model_id=args.run)).checkpoints
    if args.json:
        return json.dumps([c.model_dump() for c in ckpts], indent=2)
    return _table(
        [[c.path, c.kind, c.size_bytes, _when(c.created_at)] for c in ckpts], ["PATH", "KIND", "BYTES", "CREATED"]
    )


def cmd_download(client: TwinkleClient, args) -> str:
    out = Path(args.output or args.path.rstrip("/").rsplit("/", 1)[-1])
    names = download_checkpoint(client, args.path, out)
    return f"downloaded {args.path} -> {out}/ (PEFT folder: {', '.join(names)})"


def cmd_status(client: TwinkleClient, args) -> str:
    s = ServerStatus.model_validate(client.get("/server"))
    if args.json:
        return s.model_dump_json(indent=2)
    lines = [
        f"server {client.base_url}  ready={s.ready}  tenant={s.tenant}",
        f"queue: {s.queue_depth} pending ({s.tenant_queue_depth} yours)  "
        f"throughput: {s.requests_per_s:.2f} req/s, {s.tokens_per_s:.0f} tokens/s (last 60 s)",
        f"models per tenant: {s.max_models_per_tenant or 'unlimited'}",
        "",
    ]
    lines.append(
        _table(
            [[m.name, m.backend, m.max_context, m.vocab_size, m.live_adapters] for m in s.base_models],
            ["BASE MODEL", "BACKEND", "CONTEXT", "VOCAB", "LIVE ADAPTERS"],
        )
    )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twinkle", description="Twinkle server client: runs, checkpoints, status.")
    p.add_argument("--base-url", help="server URL (default: $TWINKLE_BASE_URL)")
    p.add_argument("--api-key", help="API key (default: $TWINKLE_API_KEY)")
    sub = p.add_subparsers(dest="command", required=True)
    runs = sub.add_parser("runs", help="list your training runs")
    runs.add_argument("--limit", type=int, default=100)
    ck = sub.add_parser("checkpoints", help="list your checkpoints")
    ck.add_argument("--run", help="only this run's")
    dl = sub.add_parser("download", help="download a checkpoint as a PEFT folder")
    dl.add_argument("path", help="tinker://<model_id>/weights/<name>")
    dl.add_argument("-o", "--output", help="folder to write (default: the checkpoint's name)")
    sub.add_parser("status", help="server capacity and queue")
    up = sub.add_parser("upload", help="upload a folder (e.g. a downloaded PEFT adapter) to a model hub")
    up.add_argument("folder")
    up.add_argument("target", help="hf://ORG/NAME (huggingface_hub) or ms://ORG/NAME (modelscope)")
    up.add_argument("--private", action="store_true", help="create the repo private")
    up.add_argument("-m", "--message", default="Upload with twinkle", help="commit message")
    ex = sub.add_parser("export", help="write base model + LoRA checkpoint merged, as a transformers folder")
    ex.add_argument(
        "--merge",
        action="store_true",
        required=True,
        help="fold the LoRA into the base weights (the only export; the unmerged adapter is the "
        "checkpoint folder itself)",
    )
    ex.add_argument("checkpoint", help="a LoRA checkpoint folder: a local PEFT folder or a server checkpoint folder")
    ex.add_argument("out", help="the folder to write (new or empty)")
    ex.add_argument("--base", help="the base model (default: the one the checkpoint names)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the base model's")
    for sp in (runs, ck, sub.choices["status"]):
        sp.add_argument("--json", action="store_true", help="machine-readable output")
    return p


COMMANDS = {"runs": cmd_runs, "checkpoints": cmd_checkpoints, "download": cmd_download, "status": cmd_status}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "upload":  # talks to a hub, not to the server
        try:
            print(
                f"uploaded {args.folder} -> "
                + upload_folder(args.folder, args.target, private=args.private or None, commit_message=args.message)
            )
        except (ValueError, ImportError, OSError) as e:  # hub HTTP errors are OSErrors in both clients
            print(f"twinkle: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "export":  # local work on torch: twinkle-model, imported only when asked for
        return _export(args)
    try:
        client = TwinkleClient(args.base_url, args.api_key, max_retries=3)
        print(COMMANDS[args.command](client, args))
    except (TwinkleAPIError, ValueError) as e:
        print(f"twinkle: {e}", file=sys.stderr)
        return 1
    except httpx.HTTPError as e:
        print(f"twinkle: cannot reach the server at {client.base_url}: {e}", file=sys.stderr)
        return 1
    return 0


def _export(args) -> int:
    try:
        from twinkle.model.export import export_merged
    except ImportError:
        print("twinkle: export needs torch and twinkle-model: pip install 'twinkle-client[export]'", file=sys.stderr)
        return 1
    try:
        print(f"wrote {export_merged(args.checkpoint, args.out, base=args.base, dtype=args.dtype)}")
    except (ValueError, OSError) as e:
        print(f"twinkle: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
