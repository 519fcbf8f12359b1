"""One way to submit a pass (serve/core/passes.py), through the real server: a native and a Tinker
forward_backward are counted and put on their run's curve by one rule; a fault of the server's inside
a pass or an adapter operation fails as the server's, with its traceback in the log, never as the
tenant's error; and a library's refusal of the tenant's own input is a user error naming that input."""

from __future__ import annotations

import logging

import httpx
import pytest

from twinkle.hub import TEST_MODEL

TENANT = "passes"
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def native(server, tenant_key):
    with httpx.Client(base_url=f"{server.url}/twinkle/v1", headers={"X-API-Key": tenant_key}, timeout=60) as http:
        yield http


def _outcome(http: httpx.Client, r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    for _ in range(20):
        out = http.get(f"/futures/{request_id}", params={"timeout": 10}).json()
        if out["status"] != "pending":
            return out
    raise TimeoutError(request_id)


def _model(http: httpx.Client, lora: dict = LORA) -> tuple[str, dict]:
    """A native model and the outcome of adding its adapter."""
    model_id = http.post("/models", json={"seed": 3}).json()["model_id"]
    return model_id, _outcome(http, http.post(f"/models/{model_id}/add_adapter_to_model", json={"lora_config": lora}))


def _fb(http: httpx.Client, model_id: str, route: str = "forward_backward") -> dict:
    rows = [{"input_ids": TOKENS, "labels": TOKENS}]
    return _outcome(http, http.post(f"/models/{model_id}/{route}", json={"inputs": {"rows": rows}}))


def _curves(http: httpx.Client, model_id: str) -> dict[str, list[tuple[int, float]]]:
    curves = http.get(f"/runs/{model_id}/curves").json()["curves"]
    return {name: [(p["step"], p["value"]) for p in points] for name, points in curves.items()}


def test_both_apis_count_and_chart_a_pass_by_one_rule(server, tenant_key, native, sft):
    import tinker

    model_id, added = _model(native)
    assert added["status"] == "complete", added
    losses = [_fb(native, model_id)["result"]["loss"] for _ in range(2)]
    assert _fb(native, model_id, "forward_only")["status"] == "complete"  # a forward is no training step
    curves = _curves(native, model_id)
    assert [step for step, _ in curves["loss"]] == [1, 2]
    assert [v for _, v in curves["loss"]] == pytest.approx(losses, rel=1e-6)
    assert curves["tokens"] == [(1, 8.0), (2, 8.0)]  # the row's input_ids
    assert "loss_tokens" not in curves  # the native loss is a mean already

    sdk = tinker.ServiceClient(base_url=server.url, api_key=tenant_key)
    tc = sdk.create_lora_training_client(base_model=TEST_MODEL, rank=4).result()
    sums = [tc.forward_backward([sft(TOKENS)], "cross_entropy").result().metrics["loss:sum"] for _ in range(2)]
    tc.forward([sft(TOKENS)], "cross_entropy").result()
    curves = _curves(native, tc.model_id)  # both APIs' runs are in one store
    assert [step for step, _ in curves["loss"]] == [1, 2]
    assert [v for _, v in curves["loss"]] == pytest.approx(sums, rel=1e-6)
    assert curves["tokens"] == curves["loss_tokens"] == [(1, 7.0), (2, 7.0)]  # the datum's model input
    training = {r["model_id"]: r["training"] for r in server.runtime.store.usage.of_runs(TENANT)}
    assert (training[model_id], training[tc.model_id]) == (3 * 8, 3 * 7)  # forwards are usage too


def test_a_fault_of_the_server_in_a_pass_is_the_servers_with_its_traceback(server, native, monkeypatch, caplog):
    from twinkle.loss import CrossEntropyLoss

    model_id, _ = _model(native)
    backend = next(iter(server.runtime.engines.values())).backend

    def buggy_loss(self, ctx):
        raise TypeError("injected: a bug in a loss")

    def buggy_metrics(*args, **kwargs):
        raise KeyError("injected: a bug in the metrics")

    monkeypatch.setattr(CrossEntropyLoss, "per_token", buggy_loss)
    monkeypatch.setattr(backend.engine, "calculate_metric", buggy_metrics)
    with caplog.at_level(logging.ERROR, logger="twinkle.serve"):
        failed = [_fb(native, model_id), _outcome(native, native.post(f"/models/{model_id}/calculate_metric", json={}))]
    for out, error in zip(failed, (TypeError, KeyError)):
        # once answered as the tenant's error with the exception's text; now the server's, its text kept inside
        assert out["status"] == "failed" and out["category"] == "server", out
        assert "internal error" in out["error"] and "injected" not in out["error"], out
        ref = out["error"].split("logged as ")[1].split(")")[0]
        logged = [rec for rec in caplog.records if ref in rec.getMessage()]
        assert logged and logged[0].exc_info is not None and logged[0].exc_info[0] is error, ref


def test_a_library_refusing_the_tenants_input_names_that_input(native):
    model_id, added = _model(native, {**LORA, "target_modules": ["no_such_proj"]})
    assert added["status"] == "failed" and added["category"] == "user", added
    assert added["error"].startswith("lora_config: ") and "no_such_proj" in added["error"], added

    model_id, _ = _model(native)
    r = native.post(f"/models/{model_id}/set_loss", json={"name": "CrossEntropyLoss", "kwargs": {"no_such_arg": 1}})
    out = _outcome(native, r)
    assert out["status"] == "failed" and out["category"] == "user", out
    assert out["error"].startswith("loss 'CrossEntropyLoss': ") and "no_such_arg" in out["error"], out
    r = native.post(f"/models/{model_id}/clip_grad_and_step", json={})
    out = _outcome(native, r)
    assert out["category"] == "user" and "call set_optimizer" in out["error"], out


def test_a_native_models_named_adapters_live_in_the_cores_one_registry(server, native):
    live = server.runtime.live
    model_id, _ = _model(native)
    second = native.post(f"/models/{model_id}/add_adapter_to_model", json={"adapter_name": "b", "lora_config": LORA})
    assert _outcome(native, second)["status"] == "complete"
    assert list(live.named(model_id)) == ["default", "b"]
    assert live.get(model_id) == live.named(model_id)["default"]  # the run's adapter: the first it holds
    assert server.runtime.store.runs.get(model_id).lora["adapters"] == ["b", "default"]
    out = _fb(native, model_id)
    assert out["category"] == "user" and "['b', 'default']: pass adapter_name" in out["error"], out
    rows = [{"input_ids": TOKENS, "labels": TOKENS}]
    r = native.post(f"/models/{model_id}/forward_backward", json={"inputs": {"rows": rows}, "adapter_name": "b"})
    assert _outcome(native, r)["status"] == "complete"
    assert _outcome(native, native.delete(f"/models/{model_id}"))["result"]["adapters"] == ["b", "default"]
    assert live.get(model_id) is None and live.named(model_id) == {}
