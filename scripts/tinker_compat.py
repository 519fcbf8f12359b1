"""Generate the Tinker SDK compatibility table: every public method of every client class the installed
`tinker` SDK exports (0.38: ServiceClient, TrainingClient, SamplingClient, RestClient, AdminClient), every
value of a sampler save's `kind` and the `DmelChunk` input (`sdk_options`), and every `tinker` CLI subcommand, called
against a real twinkle server (the embedded tiny model on loopback) and recorded as works / refused (with
the server's reason) / not applicable (with why). The table goes into docs/tinker.md between the markers.

    uv run python scripts/tinker_compat.py            # survey, print the table, rewrite docs/tinker.md's
    uv run python scripts/tinker_compat.py --print    # survey and print only

Run it again when the SDK version moves; packages/twinkle-serve/tests/test_tinker_compat_table.py fails
when a method the table records as working stops working, or when the SDK grows a method the table lacks.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import inspect
import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE_DOC = ROOT / "docs" / "tinker.md"
BEGIN, END = "<!-- tinker-compat:begin -->", "<!-- tinker-compat:end -->"
PROMPT = [5, 12, 19, 26, 33, 40]

_KIND = 'TrainingClient.save_weights_and_get_sampling_client(kind="{}")'
_DMEL = "ModelInput chunk: DmelChunk"
_JWT = (
    "the SDK asks for the hosted service's JWT sign-in, which this server reports as disabled: it "
    "authenticates `tml-` API keys (`auth/apikey/me` answers who a key is)"
)
NOT_APPLICABLE = {
    "ServiceClient.get_telemetry": "client-side: the SDK's own telemetry object",
    "TrainingClient.get_telemetry": "client-side: the SDK's own telemetry object",
    "SamplingClient.get_telemetry": "client-side: the SDK's own telemetry object",
    "RestClient.get_telemetry": "client-side: the SDK's own telemetry object",
    "AdminClient.get_telemetry": "client-side: the SDK's own telemetry object",
    "ServiceClient.get_console_url": "a link into the hosted Tinker web console; this server's dashboard is at /",
    "TrainingClient.get_console_url": "a link into the hosted Tinker web console; this server's dashboard is at /",
    "RestClient.whoami": _JWT,
    "cli: auth whoami": _JWT,
    "SamplingClient.on_queue_state_change": "a hook the SDK calls on itself when the server reports queue state",
    "SamplingClient.create": "internal constructor (takes the SDK's client holder); "
    "ServiceClient.create_sampling_client is the public way",
    "cli: checkpoint push-hf": "uploads to huggingface.co, which needs a network; tests/test_serve_tinker_cli.py "
    "drives it up to the upload against a local stand-in of the Hub",
}

# Calls that work the way stated, and only that way.
HOW = {
    "SamplingClient.get_tokenizer": "with the model's folder as the sampler's base model (the path "
    "`TrainingClient.get_info().model_data.tokenizer_id` returns, accepted as the model's name). The SDK "
    "loads `AutoTokenizer.from_pretrained(base_model.split(':')[0])` and asks the server nothing, so a "
    "`twinkle://` name becomes the hub repo `twinkle`: the call sends no request, so nothing the server "
    "answers can change that without an SDK patch; a model served under a hub id loads the hub's (or the local hub cache's) tokenizer, as on Tinker",
    _KIND.format("inflight"): "honoured: the client follows the run's one mutable target, which each later "
    "inflight save updates (checked: after a step and a save its log-probs are a new snapshot's); each "
    "client has its own KV namespace (docs/training.md)",
    _KIND.format("snapshot"): "honoured: the client's weights never change (checked after a step and a save)",
}


@dataclass
class Row:
    name: str
    status: str  # works | refused | not applicable | fails
    note: str = ""


class Context:
    """The objects the calls act on: one tenant's clients, a trained run, its checkpoints."""

    def __init__(self, url: str, key: str, base_model: str):
        import tinker
        from tinker import types

        # HF_HUB_OFFLINE: a call that reaches for the hub fails at once instead of retrying for a minute
        os.environ.update(TINKER_BASE_URL=url, TINKER_API_KEY=key, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1")
        self.url, self.key, self.base_model, self.types = url, key, base_model, types
        self.service = tinker.ServiceClient(base_url=url, api_key=key)
        self.rest = tinker.RestClient(base_url=url, api_key=key)
        self.admin = tinker.AdminClient(base_url=url, api_key=key)
        self.tc = self.service.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
        seq = [*PROMPT, 47, 54]
        self.datum = types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
        )
        self.tc.forward_backward([self.datum], "cross_entropy").result()
        self.tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        self.state_path = self.tc.save_state("state").result().path
        self.sampler_path = self.tc.save_weights_for_sampler("sampler").result().path
        self.external_path = self.tc.save_weights_external("external").result().path
        self.sc = self.service.create_sampling_client(model_path=self.sampler_path).result()
        self.session_id = self.tc.model_id.split(":")[0]
        self._n = 0

    def fresh_checkpoint(self) -> str:
        """A sampler checkpoint of its own, for calls that delete or change one."""
        self._n += 1
        return self.tc.save_weights_for_sampler(f"scratch-{self._n}").result().path

    def new_service(self, project_id: str | None = None):
        import tinker

        return tinker.ServiceClient(base_url=self.url, api_key=self.key, project_id=project_id)

    def folder_sampler(self):
        """A sampler whose base model is named by its folder: SDK 0.38's SamplingClient.get_tokenizer()
        loads AutoTokenizer.from_pretrained(base_model.split(":")[0]) and asks the server nothing, so for a
        `twinkle://...` name it looks for a hub repo `twinkle` (no answer the server gives can change that
        without an SDK patch); the folder get_info reports as tokenizer_id is accepted as the model's name."""
        folder = self.tc.get_info().model_data.tokenizer_id
        return self.service.create_sampling_client(base_model=folder, model_path=self.sampler_path).result()

    def sampler_id(self) -> str:
        """The sampling session behind `self.sc` (its handle is base64 JSON naming it)."""
        return json.loads(base64.urlsafe_b64decode(self.sc.get_sampler_handle()))["sampling_session_id"]


def _custom_loss(logprobs, weights):
    return (-(logprobs * weights)).sum(), {}


def _now(hours: int) -> datetime:
    return datetime.now(UTC) + timedelta(hours=hours)


# name -> call(ctx, bound method) (target object: the class's ctx attribute, or `target(ctx)`)
CALLS = {
    "ServiceClient.get_server_capabilities": lambda c, f: f(),
    "ServiceClient.create_lora_training_client": lambda c, f: f(base_model=c.base_model, rank=4),
    "ServiceClient.create_sampling_client": lambda c, f: f(base_model=c.base_model),
    "ServiceClient.create_training_client_from_state": lambda c, f: f(c.state_path),
    "ServiceClient.create_training_client_from_state_with_optimizer": lambda c, f: f(c.state_path),
    "ServiceClient.create_rest_client": lambda c, f: f(),
    "ServiceClient.copy_weights": (lambda c, f: f(c.state_path), lambda c: c.new_service(project_id="compat")),
    "ServiceClient.create_custom_loss": lambda c, f: f(_custom_loss, {"logprobs": 1, "weights": 1}),
    "TrainingClient.get_info": lambda c, f: f(),
    "TrainingClient.get_tokenizer": lambda c, f: f(),
    "TrainingClient.forward": lambda c, f: f([c.datum], "cross_entropy"),
    "TrainingClient.forward_backward": lambda c, f: f([c.datum], "cross_entropy"),
    "TrainingClient.forward_backward_custom": lambda c, f: f(
        [c.datum], lambda data, lps: (sum(-lp.sum() for lp in lps), {})
    ),
    "TrainingClient.optim_step": lambda c, f: f(c.types.AdamParams(learning_rate=1e-4)),
    "TrainingClient.save_state": lambda c, f: f("state-2", overwrite=True),
    "TrainingClient.load_state": lambda c, f: f(c.state_path),
    "TrainingClient.load_state_with_optimizer": lambda c, f: f(c.state_path),
    "TrainingClient.save_weights_for_sampler": lambda c, f: f("sampler-2"),
    "TrainingClient.save_weights_and_get_sampling_client": lambda c, f: f(),
    "TrainingClient.save_weights_external": lambda c, f: f("external-2"),
    "TrainingClient.create_sampling_client": lambda c, f: f(c.sampler_path),
    "SamplingClient.sample": lambda c, f: f(
        c.types.ModelInput.from_ints(PROMPT), 2, c.types.SamplingParams(max_tokens=4, seed=1)
    ),
    "SamplingClient.compute_logprobs": lambda c, f: f(c.types.ModelInput.from_ints(PROMPT)),
    "SamplingClient.get_base_model": lambda c, f: f(),
    "SamplingClient.get_tokenizer": (lambda c, f: f(), lambda c: c.folder_sampler()),
    "SamplingClient.get_sampler_handle": lambda c, f: f(),
    "SamplingClient.from_sampler_handle": lambda c, f: f(c.sc.get_sampler_handle(), api_key=c.key).sample(
        c.types.ModelInput.from_ints(PROMPT), 1, c.types.SamplingParams(max_tokens=2)
    ),
    "RestClient.whoami": lambda c, f: f(),
    "RestClient.get_server_capabilities": lambda c, f: f(),
    "RestClient.get_training_run": lambda c, f: f(c.tc.model_id),
    "RestClient.get_training_run_by_tinker_path": lambda c, f: f(c.state_path),
    "RestClient.get_weights_info_by_tinker_path": lambda c, f: f(c.state_path),
    "RestClient.list_training_runs": lambda c, f: f(),
    "RestClient.list_checkpoints": lambda c, f: f(c.tc.model_id),
    "RestClient.list_user_checkpoints": lambda c, f: f(),
    "RestClient.get_session": lambda c, f: f(c.session_id),
    "RestClient.list_sessions": lambda c, f: f(),
    "RestClient.search_sessions": lambda c, f: f(c.types.SessionSearchRequest()),
    "RestClient.assign_session_project": lambda c, f: f(c.session_id, "compat"),
    "RestClient.export_session_trace": lambda c, f: f(c.session_id),
    "RestClient.get_sampler": lambda c, f: f(c.sampler_id()),
    "RestClient.get_external_weights_urls": lambda c, f: f(c.external_path),
    "RestClient.copy_weights": lambda c, f: f(c.state_path, "compat"),
    "RestClient.get_billing_usage": lambda c, f: f(_now(-1), _now(1)),
    "RestClient.get_current_checkpoint_storage_usage": lambda c, f: f(),
    "RestClient.get_audit_log": lambda c, f: f(),
    "RestClient.publish_checkpoint_from_tinker_path": lambda c, f: f(c.sampler_path),
    "RestClient.unpublish_checkpoint_from_tinker_path": lambda c, f: f(c.sampler_path),
    "RestClient.set_checkpoint_ttl_from_tinker_path": lambda c, f: f(c.fresh_checkpoint(), 3600),
    "RestClient.delete_checkpoint": lambda c, f: f(c.tc.model_id, c.fresh_checkpoint().split("/", 3)[3]),
    "RestClient.delete_checkpoint_from_tinker_path": lambda c, f: f(c.fresh_checkpoint()),
    "AdminClient.get_audit_log": lambda c, f: f(),
    "AdminClient.get_billing_usage": lambda c, f: f(_now(-1), _now(1)),
    "AdminClient.get_current_checkpoint_storage_usage": lambda c, f: f(),
    "ServiceClient.close": (lambda c, f: f("success"), lambda c: c.new_service()),
}
TARGETS = {
    "ServiceClient": "service",
    "TrainingClient": "tc",
    "SamplingClient": "sc",
    "RestClient": "rest",
    "AdminClient": "admin",
}


def _lps(c: Context, sc) -> list[float]:
    return sc.compute_logprobs(c.types.ModelInput.from_ints([*PROMPT, 47, 54])).result()[1:]


def _kind_honoured(kind: str):
    """A call that fails unless `kind` is honoured: after a training step and a later save of the same kind, an
    inflight client samples the new weights (a new snapshot's log-probs), a snapshot client the old ones."""

    def call(c: Context) -> None:
        import math

        client = c.tc.save_weights_and_get_sampling_client(kind=kind).result()
        before = _lps(c, client)
        c.tc.forward_backward([c.datum], "cross_entropy").result()
        c.tc.optim_step(c.types.AdamParams(learning_rate=0.1)).result()
        c.tc.save_weights_and_get_sampling_client(kind=kind).result()
        now = _lps(c, c.tc.save_weights_and_get_sampling_client().result())
        got, want = _lps(c, client), now if kind == "inflight" else before
        moved = any(not math.isclose(a, b, rel_tol=1e-3) for a, b in zip(now, before))
        if not moved or not all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, want)):
            raise AssertionError(f"kind={kind!r} not honoured: log-probs {got} after the update, want {want}")

    return call


def _dmel_sample(c: Context) -> None:
    audio = c.types.DmelChunk(dmel=bytes([0, 2, 4, 80]) + bytes(320))  # a TensorContainer: uint8 [4, 80]
    prompt = c.types.ModelInput(chunks=[c.types.EncodedTextChunk(tokens=PROMPT), audio])
    c.sc.sample(prompt, 1, c.types.SamplingParams(max_tokens=2)).result()


OPTIONS = {_KIND.format("inflight"): _kind_honoured("inflight"), _KIND.format("snapshot"): _kind_honoured("snapshot")}
OPTIONS[_DMEL] = _dmel_sample

CLI = {  # subcommand -> arguments (ctx -> list)
    "auth login": lambda c: [],
    "auth status": lambda c: [],
    "auth whoami": lambda c: [],
    "auth logout": lambda c: [],
    "billing checkpoint-storage": lambda c: [],
    "billing usage": lambda c: [_now(-24).date().isoformat(), _now(24).date().isoformat()],
    "checkpoint list": lambda c: [],
    "checkpoint info": lambda c: [c.state_path],
    "checkpoint download": lambda c: [c.state_path, "--output", tempfile.mkdtemp()],
    "checkpoint publish": lambda c: [c.sampler_path],
    "checkpoint unpublish": lambda c: [c.sampler_path],
    "checkpoint set-ttl": lambda c: [c.fresh_checkpoint(), "--ttl", "3600"],
    "checkpoint delete": lambda c: [c.fresh_checkpoint(), "--yes"],
    "checkpoint push-hf": None,
    "model list": lambda c: [],
    "run list": lambda c: [],
    "run info": lambda c: [c.tc.model_id],
    "session export-trace": lambda c: [c.session_id, "--url-only"],
    "version": lambda c: [],
}


def client_classes() -> list[str]:
    """Every client class the installed SDK exports: a class the SDK adds shows up here, and fails the
    table's test until it has calls written for it."""
    import tinker

    return sorted(n for n in tinker.__all__ if n.endswith("Client") and inspect.isclass(getattr(tinker, n)))


def sdk_methods() -> list[str]:
    """`Class.method` for every public method of every client (an `_async` twin folds into its method)."""
    import tinker

    names = []
    for cls in client_classes():
        for name, value in inspect.getmembers(getattr(tinker, cls)):
            if name.startswith("_") or not callable(value) or name.endswith("_async"):
                continue
            names.append(f"{cls}.{name}")
    return sorted(names)


def sdk_options() -> list[str]:
    """Rows for what the SDK defines beyond its methods: each value of `types.SamplingClientKind` (a kind the
    SDK adds shows up here, and fails the table's test until it has a call written) and `DmelChunk` input."""
    import typing

    from tinker import types

    kinds = [_KIND.format(k) for k in typing.get_args(types.SamplingClientKind)]
    return kinds + ([_DMEL] if hasattr(types, "DmelChunk") else [])


def call_option(c: Context, name: str) -> Row:
    call = OPTIONS.get(name)
    if call is None:
        return Row(name, "fails", "no call written for it in scripts/tinker_compat.py")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            call(c)
    except Exception as e:
        status = getattr(e, "status_code", None)
        return Row(name, "refused" if status and 400 <= status < 500 else "fails", _reason(e))
    return Row(name, "works", HOW.get(name, ""))


def cli_commands() -> list[str]:
    import click
    from tinker.cli.__main__ import main_cli

    ctx, found = click.Context(main_cli), []

    def walk(group, prefix):
        for name in group.list_commands(ctx):
            cmd = group.get_command(ctx, name)
            walk(cmd, [*prefix, name]) if isinstance(cmd, click.Group) else found.append(" ".join([*prefix, name]))

    walk(main_cli, [])
    return sorted(found)


def _reason(e: Exception) -> str:
    status = getattr(e, "status_code", None)
    body = getattr(e, "body", None)
    text = (body.get("error") or body.get("detail")) if isinstance(body, dict) else None
    text = str(text or e).strip().splitlines()[0][:200]
    return f"{status}: {text}" if status else f"{type(e).__name__}: {text}"


def _resolve(out):
    return out.result(timeout=300) if hasattr(out, "result") and callable(out.result) else out


async def _resolve_async(out):
    while inspect.isawaitable(out):
        out = await out
    return _resolve(out)


def call_method(c: Context, name: str) -> Row:
    if name in NOT_APPLICABLE:
        return Row(name, "not applicable", NOT_APPLICABLE[name])
    spec = CALLS.get(name)
    if spec is None:
        return Row(name, "fails", "no call written for it in scripts/tinker_compat.py")
    call, target = spec if isinstance(spec, tuple) else (spec, None)
    cls, method = name.split(".")
    statuses = []
    for suffix in ("", "_async"):
        obj = target(c) if target else getattr(c, TARGETS[cls])
        if not hasattr(obj, method + suffix):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if suffix:
                    asyncio.run(_resolve_async(call(c, getattr(obj, method + suffix))))
                else:
                    _resolve(call(c, getattr(obj, method)))
            statuses.append(("works", ""))
        except Exception as e:
            status = getattr(e, "status_code", None)
            statuses.append(("refused" if status and 400 <= status < 500 else "fails", _reason(e)))
    worst = next((s for s in statuses if s[0] != "works"), (statuses[0][0], HOW.get(name, "")))
    return Row(name + (" (+ _async)" if len(statuses) == 2 else ""), *worst)


def call_cli(c: Context, command: str, home: str) -> Row:
    """The subcommand run in this process through click (as `tinker ...` runs it, without a
    new interpreter's start-up for each), with its own HOME for the credentials `auth` stores."""
    from click.testing import CliRunner
    from tinker.cli.__main__ import main_cli

    name = f"cli: {command}"
    if name in NOT_APPLICABLE or CLI.get(command) is None:
        return Row(name, "not applicable", NOT_APPLICABLE.get(name, "no call written for it"))
    env = {"TINKER_BASE_URL": c.url, "TINKER_API_KEY": c.key, "TINKER_TELEMETRY": "0", "HOME": home}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = CliRunner().invoke(main_cli, [*command.split(), *CLI[command](c)], input=c.key + "\n", env=env)
    if result.exit_code == 0:
        return Row(name, "works")
    error = (
        getattr(result, "stderr", "")
        if result.exception is None or isinstance(result.exception, SystemExit)
        else _reason(result.exception)
    )
    lines = [line for line in (error or result.output).strip().splitlines() if line.strip()]
    return Row(name, "refused", (lines[-1] if lines else f"exit {result.exit_code}")[:200])


def survey(url: str, key: str, base_model: str, only: set[str] | None = None) -> list[Row]:
    """Every method and subcommand (or those named in `only`), called in order. The process environment
    (the SDK reads TINKER_* from it) is restored afterwards."""
    saved = dict(os.environ)
    try:
        c = Context(url, key, base_model)
        rows = []
        methods = sorted(sdk_methods(), key=lambda n: n == "ServiceClient.close")  # ends a session: last
        for name in methods:
            if only is None or name in only:
                rows.append(call_method(c, name))
        rows += [call_option(c, name) for name in sdk_options() if only is None or name in only]
        with tempfile.TemporaryDirectory() as home:
            for command in cli_commands():
                if only is None or f"cli: {command}" in only:
                    rows.append(call_cli(c, command, home))
        return rows
    finally:
        os.environ.clear()
        os.environ.update(saved)


def table(rows: list[Row], version: str) -> str:
    counts = {s: sum(r.status == s for r in rows) for s in ("works", "refused", "not applicable", "fails")}
    lines = [
        f"Generated by `scripts/tinker_compat.py` against `tinker=={version}`: "
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        + ".",
        "",
        "| SDK surface | status | note |",
        "|---|---|---|",
    ]
    lines += [f"| `{r.name}` | {r.status} | {r.note.replace('|', '/')} |" for r in rows]
    return "\n".join(lines)


def read_table(text: str) -> dict[str, str]:
    """`name` -> status from a table written by `table` (the `(+ _async)` tag dropped)."""
    body = text.split(BEGIN, 1)[1].split(END, 1)[0]
    rows = {}
    for line in body.splitlines():
        if line.startswith("| `"):
            name, status = line[3:].split("` | ", 1)
            rows[name.removesuffix(" (+ _async)")] = status.split(" |", 1)[0]
    return rows


def write_readme(block: str) -> None:
    text = TABLE_DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    TABLE_DOC.write_text(head + BEGIN + "\n" + block + "\n" + END + rest.split(END, 1)[1])


def main() -> int:
    import tinker

    from twinkle.hub import TEST_MODEL
    from twinkle.serve import initialize

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--print", action="store_true", help="print the table, leave docs/tinker.md alone")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as data_dir:
        server = initialize(
            mode="http",
            port=0,
            data_dir=data_dir,
            config={"models": [{"name": TEST_MODEL}]},
            block=False,
            log_level="error",
        ).wait_ready()
        try:
            rows = survey(server.url, server.create_key("compat"), TEST_MODEL)
        finally:
            server.stop()
    block = table(rows, tinker.__version__)
    print(block)
    if not args.print:
        write_readme(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
