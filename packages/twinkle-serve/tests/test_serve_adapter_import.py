"""Importing a PEFT LoRA adapter made elsewhere as a training state, through the real server and both
APIs: the Tinker-side route (then the unmodified SDK's create_training_client_from_state) and the
native one (TwinkleClient.import_adapter, then load). The first forward equals the peft model's own,
training goes on from those weights, and what does not fit the base model is a 400 naming it."""

from __future__ import annotations

import base64
import json
import shutil

import httpx
import pytest
import torch

from twinkle.hub import TEST_MODEL, resolve_model_path

TENANT = "importer"
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11, 64, 8]
ATOL = 1e-5  # peft's LoRA layer and the server's fused multi-LoRA layer add the same terms in another order


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A peft adapter with non-zero B (so it changes the model), saved by peft; and its log-probs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("made-elsewhere") / "my-adapter"
    base = AutoModelForCausalLM.from_pretrained(resolve_model_path(TEST_MODEL), dtype=torch.float32)
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        base_logps = _logps(base(ids).logits)
    torch.manual_seed(3)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(base, config)
    model.save_pretrained(folder)
    with torch.no_grad():
        logps = _logps(model(ids).logits)
    assert max(abs(a - b) for a, b in zip(logps, base_logps)) > 1e-3  # the adapter matters
    return folder, logps


def _logps(logits) -> list[float]:
    targets = torch.tensor(TOKENS[1:])
    return torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, targets[:, None])[:, 0].tolist()


def _upload(folder, **changes) -> dict:
    files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in folder.iterdir() if p.name != "README.md"}
    return {"base_model": TEST_MODEL, "name": "imported", "files": files, **changes}


def _post(server, key, body):
    return httpx.post(f"{server.url}/api/v1/import_adapter", json=body, headers={"X-API-Key": key}, timeout=60)


def test_tinker_import_then_train_on_from_the_peft_weights(server, tenant_key, adapter, sft):
    import tinker
    from tinker import types

    folder, want = adapter
    r = _post(server, tenant_key, _upload(folder))
    assert r.status_code == 200, r.text
    path = r.json()["path"]
    assert path.startswith("tinker://") and path.endswith("/weights/imported")
    training = tinker.ServiceClient(base_url=server.url, api_key=tenant_key).create_training_client_from_state(path)
    training = training.result() if hasattr(training, "result") else training
    datum = sft(TOKENS)
    got = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert max(abs(a - b) for a, b in zip(got, want)) <= ATOL
    for _ in range(2):
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert sum(after) > sum(want) + 0.05  # it trained on, from the imported weights


def test_native_import_loads_into_a_model_equal_to_peft(server, tenant_key, adapter):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel as Remote

    folder, want = adapter
    client = TwinkleClient(server.url, tenant_key)
    path = client.import_adapter(folder, TEST_MODEL, name="native-import")
    assert path.endswith("/weights/native-import")
    model = Remote(model_id=TEST_MODEL, client=client)
    model.load(path).result()
    rows = [{"input_ids": TOKENS, "labels": [-100, *TOKENS[1:]]}]
    got = model.forward_only(inputs=rows).result()["logprobs"][0][1:]
    assert max(abs(a - b) for a, b in zip(got, want)) <= ATOL


def _rewritten(folder, tmp_path, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "changed"
    shutil.copytree(folder, out)
    if config is not None:
        (out / "adapter_config.json").write_text(
            json.dumps(config(json.loads((out / "adapter_config.json").read_text())))
        )
    if tensors is not None:
        save_file(tensors(load_file(str(out / "adapter_model.safetensors"))), str(out / "adapter_model.safetensors"))
    return out


def _rename_module(t: dict) -> dict:
    return {k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.qkv_fused"): v for k, v in t.items()}


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(config=lambda c: {**c, "r": 8}), "at r=8 needs"),
        (dict(tensors=_rename_module), "adapts module 'model.layers.0.self_attn.qkv_fused', which twinkle://"),
        (dict(config=lambda c: {**c, "peft_type": "IA3"}), "only LoRA adapters can be imported"),
        (dict(config=lambda c: {**c, "r": 100_000}), "adapter_config.json: r"),
        (dict(config=lambda c: {**c, "use_dora": True}), "use_dora=True is not supported"),
    ],
    ids=["rank-mismatch", "unknown-module", "not-lora", "rank-over-cap", "dora"],
)
def test_an_adapter_that_does_not_fit_is_a_400_naming_it(server, tenant_key, adapter, tmp_path, change, message):
    r = _post(server, tenant_key, _upload(_rewritten(adapter[0], tmp_path, **change)))
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_pickles_and_stray_files_are_refused(server, tenant_key, adapter):
    body = _upload(adapter[0])
    pickled = {"adapter_config.json": body["files"]["adapter_config.json"], "adapter_model.bin": "AAAA"}
    r = _post(server, tenant_key, {**body, "files": pickled})
    assert r.status_code == 400 and "'adapter_model.bin' holds pickled weights" in r.json()["error"], r.text
    r = _post(server, tenant_key, {**body, "files": {**body["files"], "run.py": "AAAA"}})
    assert r.status_code == 400 and "'run.py' is not part of a PEFT adapter upload" in r.json()["error"]
    r = _post(server, tenant_key, {**body, "files": {"adapter_config.json": body["files"]["adapter_config.json"]}})
    assert r.status_code == 400 and "needs ['adapter_model.safetensors']" in r.json()["error"]


def _nan_weight(t: dict) -> dict:
    key = next(k for k in sorted(t) if "lora_A" in k)
    bad = t[key].clone()
    bad[0, 0] = float("nan")
    return {**t, key: bad}


@pytest.mark.parametrize(
    "change,field,message",
    [
        (dict(config=lambda c: {**c, "lora_alpha": float("nan")}), "lora_alpha", "finite number"),
        (dict(config=lambda c: {**c, "lora_alpha": 1e30}), "lora_alpha", "less than or equal to 1000000"),
        (dict(config=lambda c: {**c, "lora_alpha": -8}), "lora_alpha", "greater than 0"),
        (dict(tensors=_nan_weight), "lora_A", "non-finite value"),
        (dict(config=lambda c: {**c, "target_modules": "(q_proj"}), "target_modules", "target_modules"),
        (dict(config=lambda c: {**c, "target_modules": ["qkv_fused"]}), "target_modules", "matches no Linear layer"),
        (dict(config=lambda c: {**c, "target_modules": ["q_proj"]}), "target_modules", "weights for untargeted"),
    ],
    ids=["alpha-nan", "alpha-1e30", "alpha-negative", "nan-weight", "bad-pattern", "no-layer", "targets-not-weights"],
)
def test_import_runs_the_checks_add_adapter_runs(server, tenant_key, adapter, tmp_path, change, field, message):
    """Each refusal is a 400 naming the field, and nothing is written: the tenant's runs list is unchanged."""
    import tinker

    rest = tinker.RestClient(base_url=server.url, api_key=tenant_key)
    before = rest.list_training_runs(limit=100).result().cursor.total_count
    r = _post(server, tenant_key, _upload(_rewritten(adapter[0], tmp_path, **change)))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert field in error and message in error, error
    assert rest.list_training_runs(limit=100).result().cursor.total_count == before


def test_add_adapter_refuses_what_import_refuses(server, tenant_key, adapter, tmp_path):
    """The same LoraConfig, sent to native add_adapter_to_model, is refused naming the same field."""
    created = httpx.post(f"{server.url}/twinkle/v1/models", json={}, headers={"X-API-Key": tenant_key}, timeout=60)
    model_id = created.json()["model_id"]
    for lora, field in [
        ({"r": 4, "lora_alpha": 1e30}, "lora_alpha"),
        ({"r": 4, "target_modules": "(q_proj"}, "target_modules"),
    ]:
        native = httpx.post(
            f"{server.url}/twinkle/v1/models/{model_id}/add_adapter_to_model",
            json={"adapter_name": "x", "lora_config": lora},
            headers={"X-API-Key": tenant_key},
            timeout=60,
        )
        imported = _post(
            server, tenant_key, _upload(_rewritten(adapter[0], tmp_path / field, config=lambda c, x=lora: {**c, **x}))
        )
        assert native.status_code in (400, 422) and field in native.json()["error"], native.text
        assert imported.status_code == 400 and field in imported.json()["error"], imported.text
