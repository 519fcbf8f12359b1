"""External weights: `save_weights_external`, signed `external_weights_urls` served by the server itself,
`tinker checkpoint download`, and `tinker checkpoint push-hf` up to the upload.

The push-hf upload needs the Hugging Face Hub, which these machines cannot reach: it is tested against
a local stand-in of the Hub's upload API on 127.0.0.1 (HF_ENDPOINT), which keeps the committed bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

from twinkle.hub import TEST_MODEL

sys.path.insert(0, str(Path(__file__).parent))
from _tinker_cli import HubStandIn, run_cli, run_cli_json

SEQ = [5 + (7 * i) % 60 for i in range(20)]
TENANT = "frank-external"


@pytest.fixture(scope="module")
def trained(server, tenant_key, sft):
    import tinker
    from tinker import types

    client = tinker.ServiceClient(base_url=server.url, api_key=tenant_key)
    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=5).result()
    tc.forward_backward([sft(SEQ)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    state = tc.save_state("final").result().path
    return client, tc, state


def _dir(server, path):
    return (
        server.runtime.data_dir
        / server.runtime.store.db.one("SELECT dir FROM checkpoints WHERE tinker_path=?", (path,))["dir"]
    )


def test_export_and_signed_urls(server, trained, tenant_key, keys):
    import tinker

    _, tc, state = trained
    out = tc.save_weights_external("exp-1").result()
    assert out.path == f"tinker://{tc.model_id}/external_weights/exp-1"
    rest = tinker.RestClient(base_url=server.url, api_key=tenant_key)
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[out.path].checkpoint_type == "external" and listed[out.path].size_bytes > 0
    urls = rest.get_external_weights_urls(out.path).result()
    assert set(urls.urls) == {"adapter_config.json", "adapter_model.safetensors"}
    folder = _dir(server, out.path)
    for name, url in urls.urls.items():
        r = httpx.get(url)  # no API key: the signature is the credential
        assert r.status_code == 200 and r.content == (folder / name).read_bytes()
    # the export holds the same adapter as the training state it was taken from
    assert (folder / "adapter_model.safetensors").read_bytes() == (
        _dir(server, state) / "adapter_model.safetensors"
    ).read_bytes()
    good = urls.urls["adapter_config.json"]
    tampered = good[:-1] + ("0" if good[-1] != "0" else "1")
    r = httpx.get(tampered)
    assert r.status_code == 403 and "signature" in r.json()["error"]
    # another tenant: not found; a training checkpoint: not external weights
    other = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/external_weights/exp-1/external_weights_urls",
        headers={"X-API-Key": keys["bob"]},
    )
    assert other.status_code == 404
    r = httpx.get(
        f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/final/external_weights_urls",
        headers={"X-API-Key": tenant_key},
    )
    assert r.status_code == 400 and "not external weights" in r.json()["error"]
    r = httpx.post(
        f"{server.url}/api/v1/save_weights_external",
        headers={"X-API-Key": tenant_key},
        json={"model_id": tc.model_id, "path": "x", "age_encryption_recipients": ["age1abc"]},
    )
    assert r.status_code == 400 and "age_encryption_recipients" in r.json()["error"]
    r = httpx.post(
        f"{server.url}/api/v1/save_weights_external",
        headers={"X-API-Key": keys["bob"]},
        json={"model_id": tc.model_id, "path": "x"},
    )
    assert r.status_code == 404
    # deleting the checkpoint kills its URLs
    rest.delete_checkpoint_from_tinker_path(out.path).result()
    assert httpx.get(urls.urls["adapter_config.json"]).status_code == 404


def test_cli_download_of_a_training_checkpoint(server, trained, tenant_key, tmp_path):
    _, _tc, state = trained
    out = run_cli_json(server.url, tenant_key, "checkpoint", "download", state, "--output", str(tmp_path))
    target = tmp_path / state.replace("tinker://", "").replace("/", "_")
    assert out["destination"] == str(target)
    assert sorted(p.name for p in target.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    downloaded = load_file(str(target / "adapter_model.safetensors"))
    saved = load_file(str(_dir(server, state) / "adapter_model.safetensors"))
    assert downloaded.keys() == saved.keys() and all((downloaded[k] == saved[k]).all() for k in saved)
    assert json.loads((target / "adapter_config.json").read_text())["r"] == 4
    # the temporary export was deleted after the download
    left = server.runtime.store.db.all(
        "SELECT tinker_path FROM checkpoints WHERE tenant=? AND kind='external'", (TENANT,)
    )
    assert left == []
    again = run_cli(server.url, tenant_key, "checkpoint", "download", state, "--output", str(tmp_path), check=False)
    assert again.returncode != 0 and "already exists" in again.stderr


def test_cli_push_hf_up_to_the_upload(server, trained, tenant_key):
    """Against a stand-in of the Hub's upload API on 127.0.0.1: the real Hub needs a network."""
    _, _tc, state = trained
    hub = HubStandIn()
    try:
        out = run_cli_json(
            server.url,
            tenant_key,
            "checkpoint",
            "push-hf",
            state,
            "--repo",
            "standin/adapter",
            env={"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_standin", "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"},
        )
    finally:
        hub.close()
    assert out["repo_id"] == "standin/adapter"
    repo = hub.repos[0]
    assert repo["name"] == "adapter" and (repo.get("private") is True or repo.get("visibility") == "private"), repo
    assert hub.files["adapter_model.safetensors"] == (_dir(server, state) / "adapter_model.safetensors").read_bytes()
    config = json.loads(hub.files["adapter_config.json"])
    assert config["r"] == 4 and config["base_model_name_or_path"]
    card = hub.files["README.md"].decode()
    assert f"base_model: {TEST_MODEL}" in card and state in card and "LoRA rank: 4" in card
