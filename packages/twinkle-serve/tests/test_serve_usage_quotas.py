"""Usage and quotas per key against a real server, through the native client and the tinker SDK:
tokens trained and sampled and checkpoint bytes are counted per key and per run (both APIs, the
`twinkle-server keys usage` CLI, the dashboard); quotas set with `twinkle-server keys set-quota`
refuse with 429 (tokens per day) or 409 (storage, adapters) and a JSON body naming the quota, and
survive a restart."""

from __future__ import annotations

import json

import httpx
import pytest

from twinkle.hub import TEST_MODEL

ROWS = [{"input_ids": list(range(5, 37)), "labels": list(range(5, 37))},
        {"input_ids": list(range(40, 64)), "labels": list(range(40, 64))}]
ROW_TOKENS = sum(len(r["input_ids"]) for r in ROWS)


def cli(capsys, *args) -> tuple[int, str]:
    from twinkle_server.cli import main

    rc = main(["keys", *args])
    return rc, capsys.readouterr().out


def native_model(server, key, **client_kw):
    from twinkle.client import TwinkleClient
    from twinkle.client.model import TransformersModel

    model = TransformersModel(model_id=TEST_MODEL, client=TwinkleClient(server.url, key, **client_kw))
    model.add_adapter_to_model("a", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}).result()
    return model


@pytest.fixture(scope="module")
def own_server(start, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("quota-data")
    srv = start(data_dir)
    yield srv, data_dir
    srv.stop()


def test_usage_is_counted_per_key_and_run_and_quotas_refuse_by_name(own_server, capsys):
    server, data_dir = own_server
    key = server.create_key("quota-native")
    model = native_model(server, key)
    for _ in range(2):
        model.forward_backward(inputs=ROWS).result()
    model.forward_only(inputs=ROWS[:1]).result()
    trained = 2 * ROW_TOKENS + len(ROWS[0]["input_ids"])

    rc, out = cli(capsys, "usage", "quota-native", "--json", "--data-dir", str(data_dir))
    (report,) = json.loads(out)
    assert rc == 0 and report["tokens"]["training"] == trained and report["tokens_today"] == trained
    assert [(r["model_id"], r["training"]) for r in report["runs"]] == [(model.model_id, trained)]

    # tokens per day: the next forward_backward would pass the quota -> 429 naming it (not retried)
    rc, out = cli(capsys, "set-quota", "quota-native", "--tokens-per-day", str(trained + ROW_TOKENS - 1),
                  "--data-dir", str(data_dir))
    assert rc == 0 and f"tokens_per_day {trained + ROW_TOKENS - 1}" in out
    from twinkle.client.errors import TwinkleAPIError

    with pytest.raises(TwinkleAPIError, match="tokens_per_day quota") as refused:
        model.forward_backward(inputs=ROWS)
    assert refused.value.status == 429
    raw = httpx.post(f"{server.url}/twinkle/v1/models/{model.model_id}/forward_backward", headers={"X-API-Key": key},
                     json={"inputs": {"rows": ROWS}}, timeout=30)
    assert raw.status_code == 429 and int(raw.headers["retry-after"]) > 0
    assert {k: raw.json()[k] for k in ("quota", "limit", "used")} == {
        "quota": "tokens_per_day", "limit": trained + ROW_TOKENS - 1, "used": trained}
    model.forward_backward(inputs=ROWS[1:]).result()  # still within the quota: runs

    # adapters: one live adapter is the quota -> a second answers 409
    cli(capsys, "set-quota", "quota-native", "--adapters", "1", "--data-dir", str(data_dir))
    with pytest.raises(TwinkleAPIError, match="adapters quota") as refused:
        model.add_adapter_to_model("b", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert refused.value.status == 409

    # storage: the first checkpoint fits under 1 byte used; once stored, the next save answers 409
    cli(capsys, "set-quota", "quota-native", "--storage-bytes", "1", "--data-dir", str(data_dir))
    model.save("first").result()
    raw = httpx.post(f"{server.url}/twinkle/v1/models/{model.model_id}/save", headers={"X-API-Key": key},
                     json={"name": "second"}, timeout=30)
    assert raw.status_code == 409 and raw.json()["quota"] == "storage_bytes" and raw.json()["used"] > 1

    summary = httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": key}, timeout=30).json()
    assert summary["usage"]["quotas"] == {"tokens_per_day": trained + ROW_TOKENS - 1, "storage_bytes": 1,
                                          "adapters": 1}
    (run,) = summary["runs"]
    assert run["usage"]["training"] == trained + len(ROWS[1]["input_ids"])
    assert run["usage"]["checkpoint_bytes"] == summary["usage"]["checkpoint_bytes"] > 0


def test_tinker_sdk_runs_are_counted_and_refused_alike(own_server, capsys, sft):
    import tinker
    from tinker import types

    server, data_dir = own_server
    key = server.create_key("quota-tinker")
    cli(capsys, "set-quota", "quota-tinker", "--adapters", "1", "--data-dir", str(data_dir))
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    data = [sft(list(range(5, 30)))]
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_weights_for_sampler("s1").result().path  # a sampler on a run's checkpoint: counted on the run
    sampler = service.create_sampling_client(model_path=path)
    prompt = types.ModelInput.from_ints(list(range(5, 12)))
    sampled = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=4)).result()
    n_sampled = sum(len(s.tokens) for s in sampled.sequences)

    with pytest.raises(Exception, match="adapters quota"):  # the SDK's 409 error, not retried
        service.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()

    rc, out = cli(capsys, "usage", "quota-tinker", "--json", "--data-dir", str(data_dir))
    (report,) = json.loads(out)
    assert report["tokens"] == {"training": 24, "sampling_prefill": 7, "sampling_sample": n_sampled}
    (run,) = report["runs"]
    assert run["api"] == "tinker" and run["training"] == 24 and run["sampling"] == 7 + n_sampled
    assert run["checkpoint_bytes"] == report["checkpoint_bytes"] > 0


def test_quotas_survive_a_restart(own_server, start, capsys):
    server, data_dir = own_server
    key = server.create_key("quota-restart")
    cli(capsys, "set-quota", "quota-restart", "--tokens-per-day", "10", "--data-dir", str(data_dir))
    server.stop()
    again = start(data_dir)
    try:
        model = native_model(again, key, max_retries=0)
        raw = httpx.post(f"{again.url}/twinkle/v1/models/{model.model_id}/forward_backward",
                         headers={"X-API-Key": key}, json={"inputs": {"rows": ROWS}}, timeout=30)
        assert raw.status_code == 429 and raw.json()["quota"] == "tokens_per_day" and raw.json()["limit"] == 10
    finally:
        again.stop()
