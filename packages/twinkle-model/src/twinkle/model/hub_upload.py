"""`TransformersModel.push_to_hub`: write what `save` writes (a PEFT folder for an adapter, a
`save_pretrained` folder for the whole model) into a temporary folder and upload it in one commit:
`org/name` or `hf://org/name` with huggingface_hub, `ms://org/name` with modelscope (the
`twinkle-model[modelscope]` extra). Both libraries show their own upload progress bars.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from twinkle.model.base import TwinkleModel


def _hub_and_repo(repo_id: str) -> tuple[str, str]:
    hub, _, repo = repo_id.rpartition("://")
    if hub not in ("", "hf", "ms") or repo.count("/") != 1 or not all(repo.split("/")):
        raise ValueError(f"push_to_hub needs ORG/NAME, hf://ORG/NAME or ms://ORG/NAME, got {repo_id!r}")
    return hub or "hf", repo


def _upload(
    folder: str, hub: str, repo: str, private: bool | None, token: str | None, endpoint: str | None, commit_message: str
) -> str:
    if hub == "hf":
        from huggingface_hub import HfApi

        api = HfApi(endpoint=endpoint, token=token)
        api.create_repo(repo, private=private, exist_ok=True)
        return str(api.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message))
    try:
        from modelscope.hub.api import HubApi
    except ImportError as e:
        raise ImportError("push_to_hub('ms://...') needs modelscope: pip install 'twinkle-model[modelscope]'") from e
    ms = HubApi(endpoint=endpoint, token=token)
    ms.create_repo(repo, visibility=None if private is None else ("private" if private else "public"), exist_ok=True)
    ms.upload_folder(repo_id=repo, folder_path=folder, commit_message=commit_message)
    return f"{(ms.endpoint or '').rstrip('/')}/models/{repo}"  # HubApi always has one; typed Optional


def push_to_hub(
    model: TwinkleModel,
    repo_id: str,
    adapter_name: str | None = None,
    *,
    private: bool | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str = "Upload with twinkle",
) -> str | None:
    """The commit's URL; None on ranks other than 0 (every rank saves, as `save` is collective; one uploads)."""
    hub, repo = _hub_and_repo(repo_id)
    with tempfile.TemporaryDirectory(prefix="twinkle-push-") as folder:
        model.save(folder, adapter_name=adapter_name)
        if int(os.environ.get("RANK", "0")) != 0:
            return None
        return _upload(folder, hub, repo, private, token, endpoint, commit_message)
