"""Usage and quotas per key against a real server, through the native client and the tinker SDK:
tokens trained and sampled and checkpoint bytes are counted per key and per run (both APIs, the
core's usage report, the dashboard); quotas set in the store (what `twinkle-server keys set-quota`
does: apps/twinkle-server/tests drives the command against a server process) refuse with 429 (tokens
per day) or 409 (storage, adapters) and a JSON body naming the quota, and survive a restart."""

from __future__ import annotations

import httpx
import pytest

from twinkle.hub import TEST_MODEL

ROWS = [
    {"input_ids": list(range(5, 37)), "labels": list(range(5, 37))},
    {"input_ids": list(range(40, 64)), "labels": list(range(40, 64))},
]
ROW_TOKENS = sum(len(r["input_ids"]) for r in ROWS)


def report(server, tenant: str) -> dict:
    from twinkle.serve.core.usage import UsageLedger

    return UsageLedger(server.runtime.store).report(tenant)


def set_quota(server, tenant: str, **quotas) -> dict:
    return server.runtime.store.quotas.set(tenant, **quotas)


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


def test_usage_is_counted_per_key_and_run_and_quotas_refuse_by_name(own_server):
    server, _ = own_server
    key = server.create_key("quota-native")
    model = native_model(server, key)
    for _ in range(2):
        model.forward_backward(inputs=ROWS).result()
    model.forward_only(inputs=ROWS[:1]).result()
    trained = 2 * ROW_TOKENS + len(ROWS[0]["input_ids"])

    counted = report(server, "quota-native")
    assert counted["tokens"]["training"] == trained and counted["tokens_today"] == trained
    assert [(r["model_id"], r["training"]) for r in counted["runs"]] == [(model.model_id, trained)]

    # tokens per day: the next forward_backward would pass the quota -> 429 naming it (not retried)
    set_quota(server, "quota-native", tokens_per_day=trained + ROW_TOKENS - 1)
    from twinkle.client.errors import TwinkleAPIError

    with pytest.raises(TwinkleAPIError, match="tokens_per_day quota") as refused:
        model.forward_backward(inputs=ROWS)
    assert refused.value.status == 429
    raw = httpx.post(
        f"{server.url}/twinkle/v1/models/{model.model_id}/forward_backward",
        headers={"X-API-Key": key},
        json={"inputs": {"rows": ROWS}},
        timeout=30,
    )
    assert raw.status_code == 429 and int(raw.headers["retry-after"]) > 0
    assert {k: raw.json()[k] for k in ("quota", "limit", "used")} == {
        "quota": "tokens_per_day",
        "limit": trained + ROW_TOKENS - 1,
        "used": trained,
    }
    model.forward_backward(inputs=ROWS[1:]).result()  # still within the quota: runs

    # adapters: one live adapter is the quota -> a second answers 409
    set_quota(server, "quota-native", adapters=1)
    with pytest.raises(TwinkleAPIError, match="adapters quota") as refused:
        model.add_adapter_to_model("b", {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert refused.value.status == 409

    # storage: the first checkpoint fits under 1 byte used; once stored, the next save answers 409
    set_quota(server, "quota-native", storage_bytes=1)
    model.save("first").result()
    raw = httpx.post(
        f"{server.url}/twinkle/v1/models/{model.model_id}/save",
        headers={"X-API-Key": key},
        json={"name": "second"},
        timeout=30,
    )
    assert raw.status_code == 409 and raw.json()["quota"] == "storage_bytes" and raw.json()["used"] > 1

    summary = httpx.get(f"{server.url}/twinkle/v1/dashboard/summary", headers={"X-API-Key": key}, timeout=30).json()
    assert summary["usage"]["quotas"] == {"tokens_per_day": trained + ROW_TOKENS - 1, "storage_bytes": 1, "adapters": 1}
    (run,) = summary["runs"]
    assert run["usage"]["training"] == trained + len(ROWS[1]["input_ids"])
    assert run["usage"]["checkpoint_bytes"] == summary["usage"]["checkpoint_bytes"] > 0


def test_tinker_sdk_runs_are_counted_and_refused_alike(own_server, sft):
    import tinker
    from tinker import types

    server, _ = own_server
    key = server.create_key("quota-tinker")
    set_quota(server, "quota-tinker", adapters=1)
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

    counted = report(server, "quota-tinker")
    assert counted["tokens"] == {"training": 24, "sampling_prefill": 7, "sampling_sample": n_sampled}
    (run,) = counted["runs"]
    assert run["api"] == "tinker" and run["training"] == 24 and run["sampling"] == 7 + n_sampled
    assert run["checkpoint_bytes"] == counted["checkpoint_bytes"] > 0


def test_quotas_survive_a_restart(own_server, start):
    server, data_dir = own_server
    key = server.create_key("quota-restart")
    set_quota(server, "quota-restart", tokens_per_day=10)
    server.stop()
    again = start(data_dir)
    try:
        model = native_model(again, key, max_retries=0)
        raw = httpx.post(
            f"{again.url}/twinkle/v1/models/{model.model_id}/forward_backward",
            headers={"X-API-Key": key},
            json={"inputs": {"rows": ROWS}},
            timeout=30,
        )
        assert raw.status_code == 429 and raw.json()["quota"] == "tokens_per_day" and raw.json()["limit"] == 10
    finally:
        again.stop()
