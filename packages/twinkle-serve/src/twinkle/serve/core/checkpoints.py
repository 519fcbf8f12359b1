"""Checkpoints of both APIs: one folder layout under the data dir, one record, one set of rules.

A checkpoint is `tenants/<tenant>/<run>/<weights|sampler_weights>/<name>/` holding the PEFT adapter
folder (and training state for `weights`), plus `twinkle_checkpoint.json` saying which base model
and LoRA made it. Its address is `tinker://<model_id>/<weights|sampler_weights>/<name>` in both APIs.
Folders are written to a staging directory and renamed into place, so a crash never leaves half a
checkpoint under a name. A save that runs out of disk (or quota) fails with `DiskFull`, naming the
filesystem and its free space; the staging folder is removed and the previous checkpoint of that name,
if any, is untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from twinkle.client.schema import bounds as B
from twinkle.serve.backend import UserError
from twinkle.serve.core import audit, bounds
from twinkle.serve.core.records import KIND, SEGMENT, Checkpoint, Kind, Run
from twinkle.serve.errors import BadRequest, NotFound

META_FILE = "twinkle_checkpoint.json"
# How libraries that do not raise OSError (safetensors' Rust writer) say ENOSPC / EDQUOT.
_FULL_TEXT = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


class DiskFull(OSError):
    """A checkpoint did not fit on its disk. `client_message` is what the failed future says (the
    scheduler passes it through instead of "internal error"): the checkpoint and the free space, never
    the server's folders; the log line (`str`) adds the folder and the writer's own error."""

    def __init__(self, path: str, folder: Path, cause: BaseException):
        existing = next((p for p in (folder, *folder.parents) if p.exists()), folder)
        try:
            free = f"{shutil.disk_usage(existing).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        self.client_message = (
            f"saving checkpoint {path} failed: no space left on device (or disk quota exceeded) on the "
            f"server's checkpoint storage ({free} after removing the partial files); nothing new was written "
            "under that name and a checkpoint already there is unchanged: free space and save again"
        )
        self.detail = f"{self.client_message} [folder {folder}; {type(cause).__name__}: {cause}]"
        super().__init__(errno.ENOSPC, self.detail)

    def __str__(self) -> str:
        return self.detail


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(t in str(e).lower() for t in _FULL_TEXT)


def parse_path(path) -> tuple[str, Kind, str]:
    """`tinker://{model_id}/{weights|sampler_weights}/{name}` -> (model_id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise BadRequest(f"checkpoint path {path!r} must look like tinker://<model_id>/weights/<name>")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KIND or not parts[2]:
        raise BadRequest(
            f"checkpoint path {path!r} must look like tinker://<model_id>/weights/<name> "
            "or tinker://<model_id>/sampler_weights/<name>"
        )
    return parts[0], KIND[parts[1]], parts[2]


def sampler_adapter_name(ckpt: Checkpoint) -> str:
    """The name a checkpoint's weights are loaded under on a sampler, the same from every API (so the
    Tinker and OpenAI routes share one copy). The save time is in it: a checkpoint re-saved at the same
    path is new weights, not a cache hit."""
    return "ckpt-" + hashlib.sha1(f"{ckpt.tinker_path}@{ckpt.created_at!r}".encode()).hexdigest()[:16]


def check_name(name) -> str:
    # A name becomes one directory under the tenant's folder: no separators, no '.'/'..', no NUL or
    # other control characters (the OS would refuse them mid-write, as a server error).
    if (
        not isinstance(name, str)
        or not name
        or len(name) > 128
        or name in (".", "..")
        or any(c in name for c in "/\\")
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise BadRequest(
            f"checkpoint name {name!r} must be 1-128 characters without '/', '\\', control "
            "characters, and not '.' or '..'"
        )
    return name


def _swap_into_place(staging: Path, final: Path) -> None:
    """Renames only, so the name always holds a whole checkpoint (the old one until the new one is in)."""
    if not final.exists():
        staging.rename(final)
        return
    old = final.with_name(f".{final.name}-replaced-{time.time_ns()}")
    final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


class CheckpointOps:
    def __init__(self, rt):
        self.rt, self.table = rt, rt.store.checkpoints

    def folder(self, ckpt: Checkpoint) -> Path:
        return self.rt.data_dir / ckpt.dir

    def meta(self, ckpt: Checkpoint) -> dict:
        return json.loads((self.folder(ckpt) / META_FILE).read_text())

    def readable(self, tenant: str, path, kind: Kind | None = None, *, purpose: str | None = None) -> Checkpoint:
        """A checkpoint the tenant may read (its own, or published, not expired); NotFound otherwise.
        With a `purpose` (load, sample, copy, download) the tenant is about to read its files: audited."""
        _, path_kind, _ = parse_path(path)
        ckpt = self.table.readable(path, tenant)
        if ckpt is None or ckpt.expired(time.time()) or (kind is not None and path_kind != kind):
            raise NotFound(f"checkpoint {path} not found")
        if purpose is not None:
            audit.checkpoint_read(self.rt.store, tenant, ckpt, purpose)
        return ckpt

    def owned(self, tenant: str, run_id: str, checkpoint_id: str) -> Checkpoint:
        path = f"tinker://{run_id}/{checkpoint_id}"
        parse_path(path)
        ckpt = self.table.owned(path, tenant)
        if ckpt is None:
            raise NotFound(f"checkpoint {path} not found")
        return ckpt

    def write(
        self,
        run: Run,
        kind: Kind,
        name: str,
        fill: Callable[[Path], dict],
        *,
        overwrite: bool = True,
        ttl: float | None = None,
        user_metadata: dict | None = None,
    ) -> Checkpoint:
        """`fill(staging)` writes the files and answers the metadata to record beside them."""
        path = f"tinker://{run.model_id}/{SEGMENT[kind]}/{name}"
        relative = Path("tenants", run.tenant, run.model_id.replace(":", "_"), SEGMENT[kind], name)
        final = self.rt.data_dir / relative
        if final.exists() and not overwrite:
            raise UserError(f"checkpoint {path} already exists (pass overwrite to replace it)")
        staging = None
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
            meta = fill(staging)
            (staging / META_FILE).write_text(
                json.dumps({"base_model": run.base_model, "model_id": run.model_id, **meta})
            )
            _swap_into_place(staging, final)
        except Exception as e:
            if is_disk_full(e):
                if staging is not None:  # first, so the error can say how much space is really free
                    shutil.rmtree(staging, ignore_errors=True)
                raise DiskFull(path, final.parent, e) from e
            raise
        finally:
            if staging is not None:  # a failed save leaves no partial files
                shutil.rmtree(staging, ignore_errors=True)
        now = time.time()
        ckpt = Checkpoint(
            path,
            run.tenant,
            run.model_id,
            kind,
            name,
            now,
            sum(f.stat().st_size for f in final.rglob("*") if f.is_file()),
            False,
            now + ttl if ttl else None,
            str(relative),
            {str(k): str(v) for k, v in (user_metadata or {}).items()},
        )
        self.table.put(ckpt)
        audit.checkpoint_event(self.rt.store, "checkpoint_create", ckpt, kind=kind, size_bytes=ckpt.size_bytes)
        return ckpt

    # ---- listing and housekeeping --------------------------------------------------------------
    def delete(self, ckpt: Checkpoint, reason: str = "deleted by its key") -> None:
        shutil.rmtree(self.folder(ckpt), ignore_errors=True)
        self.table.delete(ckpt.tinker_path)
        audit.checkpoint_event(self.rt.store, "checkpoint_delete", ckpt, reason=reason)

    def purge_expired(self, tenant: str) -> None:
        for ckpt in self.table.expired(tenant, time.time()):
            self.delete(ckpt, reason="its TTL expired")

    def of_run(self, tenant: str, model_id: str) -> list[Checkpoint]:
        self.purge_expired(tenant)
        return self.table.of_run(model_id, tenant)

    def of_tenant(self, tenant: str, limit: int = -1, offset: int = 0) -> list[Checkpoint]:
        self.purge_expired(tenant)
        return self.table.of_tenant(tenant, limit, offset)

    def set_ttl(self, ckpt: Checkpoint, ttl_seconds) -> None:
        if ttl_seconds is not None:
            bounds.check(B.TTL_SECONDS, "ttl_seconds", ttl_seconds)  # a positive integer the calendar can hold
        self.table.set_expiry(ckpt.tinker_path, None if ttl_seconds is None else time.time() + ttl_seconds)
        audit.checkpoint_event(self.rt.store, "checkpoint_ttl_set", ckpt, ttl_seconds=ttl_seconds)
