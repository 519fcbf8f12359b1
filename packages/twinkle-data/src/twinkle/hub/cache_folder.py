"""Publishing a built folder into a shared cache so that any process may ask for it at any time.

Many processes can want the same folder at once: the ranks of a torchrun job, the actors of a Ray
group, a server's loader thread, two test sessions. Exactly one of them builds it, under a lock
file beside the folder; the others wait on the lock and then read the finished folder.

A folder counts as present only when its manifest (written last, after the folder was verified)
lists every file with its size and sha256, and the files agree. A folder without a manifest, or
whose files disagree with it (a crash mid-copy, a hand edit, a truncated download), is rebuilt:
never trusted because one familiar file such as `config.json` exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

MANIFEST = "twinkle_manifest.json"
# Folders already hashed in full by this process: later calls check sizes only (cheap), so the
# per-model cost of a verified cache is one hash per process, not one per construction.
_VERIFIED: set[Path] = set()


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def problems(folder: Path, deep: bool = True) -> list[str]:
    """What is wrong with a published folder; empty when it is complete and intact."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return [f"{MANIFEST} is missing" if folder.exists() else "folder is missing"]
    except (ValueError, KeyError, TypeError):
        return [f"{MANIFEST} is unreadable"]
    found = []
    for name, entry in files.items():
        path = folder / name
        if not path.is_file():
            found.append(f"{name} is missing")
        elif path.stat().st_size != entry["size"]:
            found.append(f"{name} has {path.stat().st_size} bytes, expected {entry['size']}")
        elif deep and file_digest(path) != entry["sha256"]:
            found.append(f"{name} does not match its sha256")
    return found


def is_complete(folder: Path) -> bool:
    folder = folder.resolve()
    if problems(folder, deep=folder not in _VERIFIED):
        _VERIFIED.discard(folder)
        return False
    _VERIFIED.add(folder)
    return True


def publish(target: Path, build: Callable[[Path], None], verify: Callable[[Path], None]) -> Path:
    """Return `target`, building it first if it is absent or damaged.

    `build(staging)` writes every file into an empty staging folder; `verify(staging)` raises if
    the result is wrong (it runs before anything is published). The manifest is written after both,
    then the folder is moved into place with one rename.
    """
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if is_complete(target):  # another process built it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            build(staging)
            verify(staging)
            files = {
                p.name: {"size": p.stat().st_size, "sha256": file_digest(p)}
                for p in sorted(staging.iterdir())
                if p.is_file()
            }
            (staging / MANIFEST).write_text(json.dumps({"files": files}, indent=2))
            if target.exists():  # damaged: replaced whole, under the lock
                shutil.rmtree(target)
            os.rename(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _VERIFIED.add(target.resolve())
    return target
