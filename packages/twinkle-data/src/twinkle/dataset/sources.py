"""Dataset ids to data: bundled ``twinkle://`` sets, local files and folders, ``hf://`` and ``ms://``.

Hub ids go through the hub's own local cache first and, only if the dataset is not cached, to the
network, after a quick reachability probe with a short timeout: offline, they fail at once with an
``OfflineError`` that says so, never a hang. Every path ends in the same folder loader, so a hub
snapshot, a bundled set and a user's folder load identically.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

from twinkle.dataset.errors import DataError
from twinkle.dataset.readers import SUFFIXES
from twinkle.hub import OfflineError

BUNDLED_ROOT = Path(__file__).parent / "bundled"
BUNDLED = {"self-cognition": "self_cognition", "arithmetic": "arithmetic", "shapes": "shapes"}
SCHEME = "twinkle://"
KNOWN_SPLITS = ("train", "test", "validation", "valid", "dev", "eval")
_SKIP_DIRS = {".git", ".cache", ".huggingface", "__pycache__"}


def bundled_path(dataset_id: str) -> Path:
    name = dataset_id.removeprefix(SCHEME).strip("/")
    if name not in BUNDLED:
        raise DataError(f"unknown bundled dataset {dataset_id!r}; known: {', '.join(SCHEME + n for n in BUNDLED)}")
    return BUNDLED_ROOT / BUNDLED[name]


def probe_timeout() -> float:
    return float(os.environ.get("TWINKLE_HUB_TIMEOUT", "5"))


def _probe(url: str, hub: str) -> None:
    """Raise OfflineError unless ``url`` answers within the probe timeout (any HTTP status counts)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=probe_timeout()).close()
    except urllib.error.HTTPError:
        return  # the hub answered: reachable
    except (OSError, ValueError) as e:
        raise OfflineError(
            f"the {hub} hub at {url} is unreachable ({e.__class__.__name__}: {e}) and the "
            f"dataset is not in the local cache; download it elsewhere or pass a local folder"
        ) from e


def hf_snapshot(repo_id: str) -> Path:
    """Local snapshot folder of a Hugging Face dataset repo (cache first, then a download)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except LocalEntryNotFoundError:
        pass
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        raise OfflineError(f"hf://{repo_id}: HF_HUB_OFFLINE is set and the dataset is not in the local cache")
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    _probe(f"{endpoint}/api/datasets/{repo_id}", "Hugging Face")
    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", etag_timeout=probe_timeout()))
    except LocalEntryNotFoundError as e:
        raise OfflineError(f"hf://{repo_id}: download failed and nothing is cached ({e})") from e


def ms_cache_dir() -> Path:
    return Path(os.environ.get("MODELSCOPE_CACHE", Path.home() / ".cache" / "modelscope"))


def ms_snapshot(repo_id: str) -> Path:
    """Local folder of a ModelScope dataset repo: its cache layout first, then the modelscope client."""
    for cached in (ms_cache_dir() / "hub" / "datasets" / repo_id, ms_cache_dir() / "datasets" / repo_id):
        if cached.is_dir() and any(cached.iterdir()):
            return cached
    try:
        from modelscope.hub.snapshot_download import dataset_snapshot_download
    except ImportError as e:
        raise ImportError(f"ms://{repo_id} needs ModelScope: pip install 'twinkle-data[modelscope]'") from e
    endpoint = os.environ.get("MODELSCOPE_DOMAIN", "https://www.modelscope.cn").rstrip("/")
    if not endpoint.startswith("http"):
        endpoint = "https://" + endpoint
    _probe(endpoint, "ModelScope")
    try:
        return Path(dataset_snapshot_download(repo_id))
    except Exception as e:  # modelscope raises plain requests/OS errors when offline
        raise OfflineError(f"cannot download ms://{repo_id} from ModelScope: {e}") from e


def resolve_dataset_path(dataset_id: str) -> Path:
    """A local file or folder for any dataset id."""
    if dataset_id.startswith(SCHEME):
        return bundled_path(dataset_id)
    if dataset_id.startswith("hf://"):
        return hf_snapshot(dataset_id.removeprefix("hf://").strip("/"))
    if dataset_id.startswith("ms://"):
        return ms_snapshot(dataset_id.removeprefix("ms://").strip("/"))
    path = Path(dataset_id).expanduser()
    if path.exists():
        return path
    raise DataError(
        f"dataset {dataset_id!r} is neither a local file or folder nor a dataset id "
        f"({SCHEME}self-cognition, {SCHEME}arithmetic, hf://org/name, ms://org/name)"
    )


def _is_data_file(p: Path) -> bool:
    name = p.name.lower().removesuffix(".gz")
    return p.is_file() and name.endswith(SUFFIXES) and not name.startswith(".") and name != "dataset_infos.json"


def _split_of(rel: Path) -> str | None:
    """The split a file belongs to by hub naming: a folder named ``test/`` or a file ``test-0000.parquet``."""
    for part in rel.parts[:-1]:
        if part in KNOWN_SPLITS:
            return part
    stem = rel.name.split(".")[0]
    for split in KNOWN_SPLITS:
        if stem == split or stem.startswith((f"{split}-", f"{split}_")):
            return split
    return None


def split_files(path: Path, subset: str | None, split: str) -> list[Path]:
    """Data files of ``split`` (and ``subset``) in a folder laid out like a hub dataset, sorted."""
    if path.is_file():
        return [path]
    root = path
    if subset:
        candidates = [path / subset, path / "data" / subset]
        root = next((c for c in candidates if c.is_dir()), None)
        if root is None:
            subsets = sorted(p.name for p in path.iterdir() if p.is_dir() and p.name not in _SKIP_DIRS)
            raise DataError(f"{path}: no subset {subset!r}; sub-folders: {', '.join(subsets) or 'none'}")
    files = sorted(
        p for p in root.rglob("*") if _is_data_file(p) and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
    )
    if not files:
        raise DataError(f"{root}: no data files ({', '.join(SUFFIXES)})")
    if not subset:  # the default config: leave other subsets' folders out, as the hub does
        default = [f for f in files if set(f.relative_to(root).parts[:-1]) <= {"data", *KNOWN_SPLITS}]
        files = default or files
    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(_split_of(f.relative_to(root)) or "train", []).append(f)
    if split not in by_split:
        raise DataError(f"{root}: no split {split!r}; found: {', '.join(sorted(by_split))}")
    return by_split[split]
