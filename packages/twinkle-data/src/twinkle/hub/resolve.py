"""Model ids to local folders: `twinkle://` (embedded), `hf://`, `ms://`, bare hub ids, local paths.

Without network a hub id fails fast with an error that says so, never a hang: the hub clients are
asked for their local cache first and only then for a download.
"""

from __future__ import annotations

import os
from pathlib import Path

from twinkle.hub.embedded import SCHEME, embedded_path


class OfflineError(RuntimeError):
    """A hub id was asked for and the hub cannot be reached (and nothing is cached)."""


def resolve_model_path(model_id: str | os.PathLike) -> str:
    """Return a local folder that `from_pretrained` can load for `model_id`."""
    model_id = os.fspath(model_id)
    if model_id.startswith(SCHEME):
        return str(embedded_path(model_id))
    if model_id.startswith("ms://"):
        return _modelscope(model_id.removeprefix("ms://"))
    if model_id.startswith("hf://"):
        return _huggingface(model_id.removeprefix("hf://"))
    path = Path(model_id).expanduser()
    if path.exists():
        return str(path)
    if model_id.count("/") == 1 and not model_id.startswith((".", "/")):
        return _huggingface(model_id)
    raise FileNotFoundError(
        f"model {model_id!r} is neither a local folder nor a hub id (use {SCHEME}..., hf://org/name or ms://org/name)"
    )


def _huggingface(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    try:
        return snapshot_download(repo_id)
    except LocalEntryNotFoundError as e:  # raised when the hub is unreachable
        raise OfflineError(
            f"cannot download hf://{repo_id}: the Hugging Face hub is unreachable "
            f"and the model is not in the local cache ({e.__class__.__name__})"
        ) from e


def _modelscope(repo_id: str) -> str:
    try:
        from modelscope import snapshot_download
    except ImportError as e:
        raise ImportError(f"ms://{repo_id} needs ModelScope: pip install 'twinkle-data[modelscope]'") from e
    try:
        return snapshot_download(repo_id)
    except Exception as e:  # modelscope raises plain requests/OS errors when offline
        raise OfflineError(f"cannot download ms://{repo_id} from ModelScope: {e}") from e
