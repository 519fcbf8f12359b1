"""The native API through twinkle-client's proxies against the real server: configuration by name,
encoded rows and server-side chat encoding, steps, metrics, save / download / resume, sampling,
futures (pipelined, async), errors and tenant scoping, and the OpenAPI schema."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC

import httpx
import pytest

from twinkle.hub import TEST_MODEL

CHATS = [
    [{"role": "user", "content": "Who are you?"}, {"role": "assistant", "content": "I am Glimmer."}],
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
]


@pytest.fixture(scope="module")
def native(server):
    from twinkle.client import TwinkleClient

    return {name: TwinkleClient(server.url, server.create_key(name)) for name in ("nat-a", "nat-b")}


@pytest.fixture(scope="module")
def rows():
    from twinkle.template import Template

    template = Template(model_id=TEST_MODEL)
    return [template.encode({"messages": chat}) for chat in CHATS]


def new_model(client, **kw):
    from twinkle.client.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL, client=client, **kw)
    model.add_adapter_to_model("default", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]})
    return model


def test_openapi_describes_every_native_route(server):
    spec = httpx.get(f"{server.url}/openapi.json").json()
    native = {p: ops for p, ops in spec["paths"].items() if p.startswith("/twinkle/v1")}
    for op in (
        "add_adapter_to_model",
        "set_loss",
        "set_optimizer",
        "set_lr_scheduler",
        "add_metric",
        "forward",
        "forward_only",
        "forward_backward",
        "clip_grad_and_step",
        "calculate_metric",
        "save",
        "load",
        "resume_from_checkpoint",
    ):
        body = native[f"/twinkle/v1/models/{{model_id}}/{op}"]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"]["$ref"].startswith("#/components/schemas/"), op
    assert {
        "/twinkle/v1/sample",
        "/twinkle/v1/futures/{request_id}",
        "/twinkle/v1/runs",
        "/twinkle/v1/server",
        "/twinkle/v1/checkpoints/archive",
        "/twinkle/v1/dashboard/summary",
    } <= set(native)
    schemas = spec["components"]["schemas"]
    assert {
        "LoraConfigModel",
        "EncodedRow",
        "Trajectory",
        "FutureResult",
        "SampleRequest",
        "ForwardResult",
        "StepResult",
        "CheckpointRef",
        "SampleResult",
    } <= set(schemas)


def test_train_save_download_resume(native, rows, tmp_path):
    from peft import LoraConfig
    from safetensors.torch import load_file

    from twinkle.client import TwinkleRequestFailed
    from twinkle.client.cli import main as cli
    from twinkle.client.model import TransformersModel

    a = native["nat-a"]
    model = new_model(a, name="roundtrip")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=1e-2)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=10)
    model.add_metric("TokenAccuracy", is_training=False)
    first = model.forward_backward(inputs=rows)
    server_encoded = model.forward_only(inputs=CHATS)  # raw chats: the server's template encodes them
    step = model.clip_grad_and_step().result()
    assert step["stepped"] and step["grad_norm"] > 0
    after = model.forward_only(inputs=rows).result()
    # chats encoded on the server == rows encoded here: same loss before the step
    assert server_encoded.result()["loss"] == pytest.approx(first.result()["loss"], abs=1e-6)
    assert after["loss"] < first["loss"]
    assert [len(lp) for lp in after["logprobs"]] == [len(r["input_ids"]) for r in rows]
    metrics = model.calculate_metric(is_training=True).result()
    assert metrics["step"] == 1.0 and metrics["loss"] == pytest.approx(first["loss"])
    # the server's engine counts FLOPs like the library's: a tenant sees its own throughput and MFU
    assert metrics["tokens_per_s"] > 0 and 0 < metrics["mfu"] < 1

    path = model.save("ckpt-1", save_training_state=True).result()
    assert path == f"tinker://{model.model_id}/weights/ckpt-1"
    args = ["--base-url", a.base_url, "--api-key", a.api_key]
    assert cli([*args, "download", path, "-o", str(tmp_path / "peft")]) == 0
    config = LoraConfig.from_pretrained(str(tmp_path / "peft"))
    assert config.r == 4 and set(config.target_modules) == {"q_proj", "v_proj"}
    assert any(k.endswith("q_proj.lora_B.weight") for k in load_file(tmp_path / "peft" / "adapter_model.safetensors"))

    resumed = TransformersModel(model_id=TEST_MODEL, client=a)
    with pytest.raises(TwinkleRequestFailed, match="call set_optimizer"):  # as locally: configure first
        resumed.resume_from_checkpoint(path).result()
    resumed.load(path).result()  # the adapter, built from the checkpoint's own LoraConfig
    resumed.set_optimizer("AdamW", lr=1e-2)
    resumed.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=0, num_training_steps=10)
    out = resumed.resume_from_checkpoint(path).result()
    assert out["resumed"] and out["optimizer_steps"] == 1
    again = resumed.forward_only(inputs=rows).result()
    assert again["logprobs"] == after["logprobs"]  # bit-exact weights


def test_runs_checkpoints_status_cli(native, capsys):
    from twinkle.client.cli import main as cli

    a = native["nat-a"]
    args = ["--base-url", a.base_url, "--api-key", a.api_key]
    assert cli([*args, "runs", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)
    assert any(r["name"] == "roundtrip" and r["api"] == "native" and r["steps"] >= 1 for r in runs)
    assert cli([*args, "checkpoints"]) == 0
    assert "weights/ckpt-1" in capsys.readouterr().out
    assert cli([*args, "status"]) == 0
    out = capsys.readouterr().out
    assert TEST_MODEL in out and "queue:" in out
    b = native["nat-b"]
    assert cli(["--base-url", b.base_url, "--api-key", b.api_key, "runs", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []  # another tenant sees none of them


def test_pipelined_calls_run_in_order_and_await(native, rows):
    model = new_model(native["nat-a"])
    model.set_optimizer("SGD", lr=0.5)
    futures = []
    for _ in range(3):  # nothing waited on until the end: the server queues them in call order
        futures.append(model.forward_backward(inputs=rows))
        futures.append(model.clip_grad_and_step())
    losses = [f.result()["loss"] for f in futures[::2]]
    assert losses[0] > losses[1] > losses[2]

    async def run():
        return await model.forward_only(inputs=rows)

    assert asyncio.run(run())["loss"] < losses[2]


def test_sampling_from_a_training_model(native, rows):
    from twinkle.client.sampler import Sampler

    model = new_model(native["nat-a"])
    sampler = Sampler(model_id=TEST_MODEL, client=native["nat-a"])
    sampler.add_adapter_from_model("mine", model)
    (out,) = sampler.sample(CHATS[:1], {"max_tokens": 5, "num_samples": 2, "seed": 1}, adapter_name="mine").result()
    assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 5 for s in out.sequences)
    (base,) = sampler.sample([rows[0]["input_ids"][:6]], {"max_tokens": 3, "temperature": 0.0}).result()
    assert len(base.sequences[0].tokens) <= 3 and isinstance(base.sequences[0].text, str)


def test_errors_are_clear_and_scoped(native, rows, server):
    from twinkle.client import TwinkleAPIError, TwinkleRequestFailed
    from twinkle.client.model import TransformersModel

    model = new_model(native["nat-a"])
    with pytest.raises(TwinkleRequestFailed, match="unknown loss 'NoSuchLoss'") as err:
        model.set_loss("NoSuchLoss").result()
    assert err.value.category == "user"
    with pytest.raises(TwinkleRequestFailed, match="no adapter 'other'"):
        model.forward_backward(inputs=rows, adapter_name="other").result()
    with pytest.raises(TwinkleRequestFailed, match="outside the vocabulary"):
        model.forward_backward(inputs=[{"input_ids": [1, 10**7], "labels": [1, 2]}]).result()
    with pytest.raises(TwinkleAPIError, match="404") as err:
        TransformersModel.attach(model.model_id, client=native["nat-b"]).calculate_metric()
    r = httpx.post(f"{server.url}/twinkle/v1/models", json={}, headers={"X-API-Key": "tml-nope"})
    assert r.status_code == 401 and "API key" in r.json()["error"]


def test_finishing_a_native_models_session_over_tinker_leaves_it_to_the_native_api(native, rows, server):
    """The Tinker finish route on the session behind a native model must not free that model's
    adapter: the native API owns it (and its adapter-memory share) and frees it on DELETE."""
    client = native["nat-a"]
    model = new_model(client)
    model.set_optimizer("AdamW", lr=1e-4)  # no implicit optimizer (the TwinkleModel contract)
    before = float(model.forward_backward(inputs=rows)["loss"])
    model.clip_grad_and_step()
    session = server.runtime.store.db.one("SELECT session_id FROM models WHERE model_id=?", (model.model_id,))[
        "session_id"
    ]
    r = httpx.post(f"{server.url}/api/v1/sessions/{session}/finish", headers={"X-API-Key": client.api_key}, json={})
    assert r.status_code == 200
    after = float(model.forward_backward(inputs=rows)["loss"])  # still trains: the adapter is still there
    assert after < before


def test_native_training_tokens_show_in_the_usage_report(server, rows):
    """Usage is counted by the service core: a native run's forward_backward and forward_only tokens are
    in the same billing report the Tinker SDK reads (`/api/v1/billing/usage/events`)."""
    from datetime import datetime, timedelta

    from twinkle.client import TwinkleClient

    client = TwinkleClient(server.url, server.create_key("nat-usage"))
    model = new_model(client)
    model.forward_backward(inputs=rows).result()
    model.forward_only(inputs=rows[:1]).result()
    now = datetime.now(UTC)
    usage = httpx.get(
        f"{server.url}/api/v1/billing/usage/events",
        headers={"X-API-Key": client.api_key},
        params={
            "starting_on": (now - timedelta(hours=2)).isoformat(),
            "ending_before": (now + timedelta(hours=1)).isoformat(),
        },
        timeout=30,
    ).json()
    training = [row for row in usage["data"] if row["event_info"]["type"] == "training"]
    assert sum(row["event_info"]["token_count"] for row in training) == (
        sum(len(r["input_ids"]) for r in rows) + len(rows[0]["input_ids"])
    )
    assert {row["base_model"] for row in training} == {TEST_MODEL}
