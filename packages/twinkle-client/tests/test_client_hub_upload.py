"""`twinkle upload PATH hf://org/name | ms://org/name` against local STAND-INs of the Hugging Face Hub's
and ModelScope's upload APIs (tests/hub_standin.py: create repo, LFS batch + PUT, commit; no hub is
reachable from these machines). The real `twinkle` console script runs huggingface_hub's own create_repo/upload_folder, and the
stand-in's received bytes must equal the local files. Also: `twinkle download`'s progress bar."""

from __future__ import annotations

import importlib.util
import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

_spec = importlib.util.spec_from_file_location("hub_standin", Path(__file__).with_name("hub_standin.py"))
hub_standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hub_standin)

TWINKLE = str(Path(sys.executable).with_name("twinkle"))


def adapter_folder(root: Path) -> dict[str, bytes]:
    files = {
        "adapter_config.json": b'{"peft_type": "LORA", "r": 4}',
        "adapter_model.safetensors": os.urandom(300_000),
        "tokenizer/tokenizer_config.json": b'{"model_max_length": 128}',
    }
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def run_cli(*args, endpoint, token=hub_standin.TOKEN):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_TOKEN": token, "HF_HUB_DISABLE_XET": "1"}
    return subprocess.run([TWINKLE, "upload", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_upload_sends_the_folder_byte_for_byte(tmp_path):
    files = adapter_folder(tmp_path)
    with hub_standin.HubStandIn() as hub:
        out = run_cli(str(tmp_path), "hf://lantern-labs/glimmer-lora", endpoint=hub.endpoint)
        assert out.returncode == 0, out.stderr
        assert hub.repos["lantern-labs/glimmer-lora"] == files
        assert hub.lfs_paths == ["adapter_model.safetensors"]  # the weights took the LFS route
        assert f"{hub.endpoint}/lantern-labs/glimmer-lora/commit/" in out.stdout

        # Again into the now existing repo (create answers 409; the upload goes on), changed weights.
        files["adapter_model.safetensors"] = os.urandom(1000)
        (tmp_path / "adapter_model.safetensors").write_bytes(files["adapter_model.safetensors"])
        assert run_cli(str(tmp_path), "hf://lantern-labs/glimmer-lora", endpoint=hub.endpoint).returncode == 0
        assert hub.repos["lantern-labs/glimmer-lora"] == files
        assert hub.requests.count("POST /api/repos/create") == 2


def test_cli_upload_errors_are_one_line(tmp_path):
    adapter_folder(tmp_path)
    with hub_standin.HubStandIn() as hub:
        out = run_cli(str(tmp_path), "hf://org/name", endpoint=hub.endpoint, token="hf_wrong")
        assert out.returncode == 1 and "twinkle: " in out.stderr and "401" in out.stderr
        assert hub.repos == {}
        out = run_cli(str(tmp_path), "org/name", endpoint=hub.endpoint)
        assert out.returncode == 1 and "'org/name' is not hf://ORG/NAME or ms://ORG/NAME" in out.stderr
        out = run_cli(str(tmp_path / "missing"), "hf://org/name", endpoint=hub.endpoint)
        assert out.returncode == 1 and "missing is not a folder" in out.stderr
        assert hub.requests == ["POST /api/repos/create"]  # only the refused one reached the hub


def run_ms_cli(*args, hub, cache: Path, token=hub_standin.MS_TOKEN):
    env = {
        **os.environ,
        "MODELSCOPE_ENDPOINT": hub.endpoint,
        "MODELSCOPE_API_TOKEN": token,
        "MODELSCOPE_CACHE": str(cache),
    }
    return subprocess.run([TWINKLE, "upload", *args], capture_output=True, text=True, env=env, timeout=120)


def test_ms_upload_sends_the_folder_byte_for_byte_through_modelscope(tmp_path):
    """ms:// runs modelscope's own HubApi.create_repo + upload_folder against the ModelScope stand-in."""
    folder = tmp_path / "adapter"
    files = adapter_folder(folder)
    with hub_standin.ModelScopeStandIn() as hub:
        out = run_ms_cli(str(folder), "ms://lantern-labs/glimmer-lora", hub=hub, cache=tmp_path / "ms")
        assert out.returncode == 0, out.stderr
        assert hub.repos["lantern-labs/glimmer-lora"] == files  # nothing more (no upload cache file), nothing less
        assert hub.lfs_paths == ["adapter_model.safetensors"]
        assert out.stdout.strip() == f"uploaded {folder} -> {hub.endpoint}/models/lantern-labs/glimmer-lora"
        assert "Committing batches" in out.stderr  # modelscope's own progress bar

        # Again into the now existing repo (create answers 409; the upload goes on), changed weights.
        files["adapter_model.safetensors"] = os.urandom(1000)
        (folder / "adapter_model.safetensors").write_bytes(files["adapter_model.safetensors"])
        out = run_ms_cli(str(folder), "ms://lantern-labs/glimmer-lora", hub=hub, cache=tmp_path / "ms")
        assert out.returncode == 0, out.stderr
        assert hub.repos["lantern-labs/glimmer-lora"] == files
        assert hub.requests[0] == "POST /api/v1/models"


def test_ms_upload_refusal_is_one_line(tmp_path):
    adapter_folder(tmp_path)
    with hub_standin.ModelScopeStandIn() as hub:
        out = run_ms_cli(str(tmp_path), "ms://org/name", hub=hub, cache=tmp_path / "ms", token="ms-not-the-token")
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert "twinkle: ModelScope refused the upload to ms://org/name" in out.stderr and "401" in out.stderr
        assert hub.repos == {} and hub.requests == ["POST /api/v1/models"]


@pytest.mark.parametrize(
    "hub, package, extra", [("hf", "huggingface_hub", "hf"), ("ms", "modelscope.hub.api", "modelscope")]
)
def test_a_missing_hub_client_names_the_extra(tmp_path, monkeypatch, hub, package, extra):
    from twinkle.client.hub_upload import upload_folder

    adapter_folder(tmp_path)
    monkeypatch.setitem(sys.modules, package, None)
    with pytest.raises(ImportError, match=rf"pip install 'twinkle-client\[{extra}\]'"):
        upload_folder(tmp_path, f"{hub}://org/name")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _archive_client():
    from twinkle.client.http import TwinkleClient

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_model.safetensors", os.urandom(200_000))
    archive = buf.getvalue()
    client = TwinkleClient("http://twinkle.invalid", "tml-x")
    client.http = httpx.Client(
        base_url=client.base_url,
        transport=httpx.MockTransport(
            lambda request: httpx.Response(200, content=archive, headers={"Content-Length": str(len(archive))})
        ),
    )
    return client, archive


def test_download_shows_a_bar_on_a_terminal_and_nothing_otherwise():
    from twinkle.client.download import fetch_archive

    client, archive = _archive_client()
    terminal, pipe = _Terminal(), io.StringIO()
    assert fetch_archive(client, "tinker://m/weights/step-3", file=terminal) == archive
    assert "step-3" in terminal.getvalue() and "100%" in terminal.getvalue()
    assert fetch_archive(client, "tinker://m/weights/step-3", file=pipe) == archive
    assert pipe.getvalue() == ""
