"""Upload a folder (a downloaded PEFT adapter, a checkpoint) to a model hub: `hf://org/name` with
huggingface_hub's `create_repo` + `upload_folder`, `ms://org/name` with modelscope's `HubApi`. Each
library is imported only when its hub is named (`pip install 'twinkle-client[hf]'` / `[modelscope]`)
and shows its own upload progress bars. Endpoints and tokens come from each library's usual settings
(HF_ENDPOINT / HF_TOKEN or `hf auth login`; MODELSCOPE_ENDPOINT / MODELSCOPE_API_TOKEN) unless given.
"""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
from pathlib import Path

_TARGET = re.compile(r"(hf|ms)://([\w.\-]+/[\w.\-]+)")


def parse_target(target: str) -> tuple[str, str]:
    """`hf://org/name` -> ("hf", "org/name"); anything else raises, naming the accepted forms."""
    match = _TARGET.fullmatch(target.strip())
    if not match:
        raise ValueError(f"upload target {target!r} is not hf://ORG/NAME or ms://ORG/NAME")
    return match[1], match[2]


_EXTRAS = {"hf": ("huggingface_hub", "hf"), "ms": ("modelscope", "modelscope")}  # hub -> (package, extra)


def _import(module: str, hub: str):
    package, extra = _EXTRAS[hub]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"uploading to {hub}:// needs the {package!r} package: pip install 'twinkle-client[{extra}]'"
        ) from e


def _check_folder(folder: str | Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    if not any(p.is_file() for p in folder.rglob("*")):
        raise ValueError(f"{folder} holds no files to upload")
    return folder


def upload_folder(
    folder: str | Path,
    target: str,
    *,
    private: bool | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    commit_message: str = "Upload with twinkle",
) -> str:
    """Create the repo if needed, upload every file of `folder` in one commit; returns the commit's URL."""
    hub, repo_id = parse_target(target)
    folder = _check_folder(folder)
    if hub == "hf":
        hf = _import("huggingface_hub", "hf")
        api = hf.HfApi(endpoint=endpoint, token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        return str(api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message))
    ms = _import("modelscope.hub.api", "ms")
    api = ms.HubApi(endpoint=endpoint, token=token)
    visibility = None if private is None else ("private" if private else "public")
    try:
        api.create_repo(repo_id, visibility=visibility, exist_ok=True)
        # modelscope prints an upload report on stdout: stderr with its bars, so stdout stays the result.
        with contextlib.redirect_stdout(sys.stderr):
            api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message)
    except Exception as e:  # modelscope's error classes moved between releases (now modelscope_hub's)
        raise OSError(f"ModelScope refused the upload to ms://{repo_id}: {e}") from e
    return f"{api.endpoint.rstrip('/')}/models/{repo_id}"
