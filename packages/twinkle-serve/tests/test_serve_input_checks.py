"""Input checked where it is used, once per concept, through the real server (issue 43, classes 3, 6, 7):
non-finite AdamParams that the SDK sends as `null` are 400s naming the field (not the default lr);
scheduler arguments that would break a schedule are refused at set_lr_scheduler; `log` and every
object a key creates are bounded; sparse tensors with out-of-range CSR indices are 400s; a failed
load names the checkpoint, not the server's folders; a fault of the server is a logged 500 (or a
"server" future) that tells nothing of its insides."""

from __future__ import annotations

import logging
import math

import httpx
import numpy as np
import pytest

from twinkle.hub import TEST_MODEL

TENANT = "checker"
TOKENS = [5, 17, 42, 99, 7, 3, 250, 11]


def _native(server, key):
    return httpx.Client(base_url=f"{server.url}/twinkle/v1", headers={"X-API-Key": key}, timeout=60)


def _tinker(server, key):
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def _tinker_result(http: httpx.Client, r: httpx.Response, deadline_polls: int = 60) -> dict:
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    for _ in range(deadline_polls):
        answer = http.post("/retrieve_future", json={"request_id": request_id})
        if answer.headers["content-type"].startswith("application/x-protobuf"):
            return {"proto": answer.content}
        out = answer.json()
        if out.get("type") != "try_again":
            return out
    raise TimeoutError(request_id)


def _tinker_model(http: httpx.Client, seq: int = 0, session: str | None = None, **lora) -> str:
    """A new Tinker training model (rank 2 unless `lora` says otherwise) in a new session or `session`."""
    session = session or http.post("/create_session", json={"tags": []}).json()["session_id"]
    body = {"session_id": session, "model_seq_id": seq, "base_model": TEST_MODEL, "lora_config": {"rank": 2, **lora}}
    return _tinker_result(http, http.post("/create_model", json=body))["model_id"]


def _native_result(http: httpx.Client, r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text
    for _ in range(60):
        out = http.get(f"/futures/{r.json()['request_id']}", params={"timeout": 10}).json()
        if out["status"] != "pending":
            return out
    raise TimeoutError(r.json())


@pytest.fixture(scope="module")
def native_model(server, tenant_key):
    http = _native(server, tenant_key)
    model_id = http.post("/models", json={"seed": 1}).json()["model_id"]
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    out = _native_result(http, http.post(f"/models/{model_id}/add_adapter_to_model", json={"lora_config": lora}))
    assert out["status"] == "complete", out
    yield http, model_id
    http.close()


@pytest.mark.parametrize("field,value", [("learning_rate", math.nan), ("beta1", math.inf), ("eps", -math.inf)])
def test_a_non_finite_adam_param_sent_by_the_sdk_is_a_400_naming_it(server, tenant_key, sft, field, value):
    """The unmodified SDK serialises the NaN as `null`: before, that read as "not given" (the default lr)."""
    import tinker
    from tinker import types

    training = tinker.ServiceClient(base_url=server.url, api_key=tenant_key).create_lora_training_client(
        base_model=TEST_MODEL, rank=4, seed=1
    )
    training.forward_backward([sft(TOKENS)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError) as err:
        training.optim_step(types.AdamParams(**{field: value})).result()
    assert f"adam_params.{field} = null is not a number" in str(err.value), err.value
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result() is not None  # the run goes on


@pytest.mark.parametrize(
    "name,kwargs,field",
    [
        ("StepLR", {"step_size": 0}, "step_size"),
        ("cosine", {"num_warmup_steps": 0, "num_training_steps": -5}, "num_training_steps"),
        ("MultiStepLR", {"milestones": [3, -1]}, "milestones"),
    ],
)
def test_set_lr_scheduler_refuses_a_breaking_argument_at_the_call(native_model, name, kwargs, field):
    http, model_id = native_model
    assert (
        http.post(f"/models/{model_id}/set_optimizer", json={"name": "AdamW", "kwargs": {"lr": 1e-3}}).status_code
        == 200
    )
    r = http.post(f"/models/{model_id}/set_lr_scheduler", json={"name": name, "kwargs": kwargs})
    assert r.status_code == 400 and f"kwargs.{field}" in r.json()["error"], r.text
    ok = http.post(f"/models/{model_id}/set_lr_scheduler", json={"name": "StepLR", "kwargs": {"step_size": 2}})
    assert _native_result(http, ok)["status"] == "complete"


def test_log_bounds_the_names_a_run_may_have(server, native_model):
    http, model_id = native_model
    caps = server.runtime.config.caps
    long = "x" * (caps.max_metric_name_chars + 1)
    r = http.post(f"/models/{model_id}/log", json={"step": 1, "metrics": {long: 1.0}})
    assert r.status_code == 400 and "caps.max_metric_name_chars" in r.json()["error"], r.text
    have = len(server.runtime.store.curves.names(model_id))
    room = caps.max_metric_names - have
    first = {f"m{i}": float(i) for i in range(room)}
    assert http.post(f"/models/{model_id}/log", json={"step": 1, "metrics": first}).status_code == 200
    assert http.post(f"/models/{model_id}/log", json={"step": 2, "metrics": first}).status_code == 200  # known names
    r = http.post(f"/models/{model_id}/log", json={"step": 2, "metrics": {"one_more": 1.0}})
    assert r.status_code == 400 and f"at most {caps.max_metric_names} (caps.max_metric_names)" in r.json()["error"]
    names = server.runtime.store.curves.names(model_id)
    assert len(names) == caps.max_metric_names and "one_more" not in names and long not in names


def test_sampling_sessions_and_checkpoints_count_against_the_key_creation_limits(server):
    from twinkle.serve.config import Limits

    burst = f"{TENANT}-burst"  # its own key: the limits' buckets are per key, made on first use
    server.runtime.limits.overrides[burst] = Limits(samplers_per_minute=3, checkpoints_per_minute=2)
    try:
        http = _tinker(server, server.create_key(burst))
        session = http.post("/create_session", json={"tags": []}).json()["session_id"]
        samplers = [
            http.post(
                "/create_sampling_session",
                json={"session_id": session, "sampling_session_seq_id": i, "base_model": TEST_MODEL},
            )
            for i in range(4)
        ]
        assert [r.status_code for r in samplers] == [200, 200, 200, 429], [r.text for r in samplers]
        assert "samplers created per minute" in samplers[-1].text and int(samplers[-1].headers["retry-after"]) >= 1
        model_id = _tinker_model(http, 0, session)
        saves = [http.post("/save_weights", json={"model_id": model_id, "path": f"c{i}"}) for i in range(3)]
        assert [r.status_code for r in saves] == [200, 200, 429], [r.text for r in saves]
        assert "checkpoints created per minute" in saves[-1].text
        http.close()
    finally:
        server.runtime.limits.overrides.pop(burst, None)


def test_a_burst_of_sessions_holds_no_more_than_the_keys_live_cap(server):
    from twinkle.serve.config import Limits

    burst = f"{TENANT}-sessions"
    server.runtime.limits.overrides[burst] = Limits(max_live_sessions=3)
    try:
        http = _tinker(server, server.create_key(burst))
        made = [http.post("/create_session", json={"tags": []}) for _ in range(5)]
        assert [r.status_code for r in made] == [200, 200, 200, 429, 429], [r.text for r in made]
        assert "limits.max_live_sessions" in made[-1].text and int(made[-1].headers["retry-after"]) == 60
        first = made[0].json()["session_id"]
        assert http.post(f"/sessions/{first}/finish", json={}).status_code == 200  # a finished one frees its place
        assert http.post("/create_session", json={"tags": []}).status_code == 200
        assert http.post("/create_session", json={"tags": []}).status_code == 429
        http.close()
    finally:
        server.runtime.limits.overrides.pop(burst, None)


def _sparse_weights_body(model_id: str, crow: list[int], col: list[int], values: list[float]) -> bytes:
    from twinkle.serve.tinker import wire_proto as pb

    n = len(TOKENS) - 1
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.asarray(TOKENS[:-1], dtype=np.int32).tobytes()
    targets = d.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT64, np.asarray(TOKENS[1:], dtype=np.int64).tobytes()
    targets.shape.extend([n])
    w = d.loss_fn_inputs["weights"]
    w.dtype = pb.DTYPE_FLOAT32
    w.shape.extend([1, n])
    w.sparse_csr.values = np.asarray(values, dtype=np.float32).tobytes()
    w.sparse_csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
    w.sparse_csr.col_indices = np.asarray(col, dtype=np.int64).tobytes()
    return msg.SerializeToString()


@pytest.mark.parametrize(
    "crow,col",
    [([0, 2], [0, 1_000_000]), ([0, 2], [0, -3]), ([0, 5], [0, 1]), ([1, 2], [0, 1]), ([0, 2, 2], [0, 1])],
    ids=["column-past-the-end", "negative-column", "offsets-past-the-values", "offsets-not-from-0", "rows"],
)
def test_sparse_tensors_with_out_of_range_csr_indices_are_400s_naming_the_field(server, tenant_key, crow, col):
    http = _tinker(server, tenant_key)
    model_id = _tinker_model(http)
    r = http.post(
        "/forward_backward",
        content=_sparse_weights_body(model_id, crow, col, [1.0, 1.0]),
        headers={"content-type": "application/x-protobuf"},
    )
    assert r.status_code == 400, r.text
    assert "loss_fn_inputs['weights']" in r.json()["error"] and "CSR layout" in r.json()["error"], r.text
    ok = http.post(
        "/forward_backward",
        content=_sparse_weights_body(model_id, [0, 2], [0, 3], [1.0, 1.0]),
        headers={"content-type": "application/x-protobuf"},
    )
    assert "proto" in _tinker_result(http, ok)  # the same layout, in range, trains
    http.close()


def test_a_failed_load_names_the_checkpoint_not_the_servers_folders(server, tenant_key):
    """A checkpoint that adapts other layers than the model it is loaded into: the library names the
    folder it read; the tenant is told "the checkpoint", not the data dir and its layout."""
    http = _tinker(server, tenant_key)
    session = http.post("/create_session", json={"tags": []}).json()["session_id"]
    mlp, no_mlp = (_tinker_model(http, seq, session, train_mlp=mlp) for seq, mlp in ((10, True), (11, False)))
    path = _tinker_result(http, http.post("/save_weights", json={"model_id": mlp, "path": "with-mlp"}))["path"]
    out = _tinker_result(http, http.post("/load_weights", json={"model_id": no_mlp, "path": path, "optimizer": False}))
    assert out["category"] == "user" and "does not fit" in out["error"], out
    assert "the checkpoint" in out["error"], out
    assert str(server.runtime.data_dir) not in out["error"] and "tenants" not in out["error"], out
    http.close()


def test_a_fault_of_the_server_is_a_logged_500_without_its_insides(server, tenant_key, monkeypatch, caplog):
    from twinkle.serve.tinker import model_names

    http = _tinker(server, tenant_key)
    model_id = _tinker_model(http)
    secret = f"{server.runtime.data_dir}/twinkle.db"

    def broken(engine):
        raise AttributeError(f"'NoneType' object has no attribute 'model_type' (reading {secret})")

    monkeypatch.setattr(model_names, "arch", broken)
    with caplog.at_level(logging.ERROR, logger="twinkle.serve"):
        r = http.post("/get_info", json={"model_id": model_id})
    assert r.status_code == 500, r.text  # a bug in our code is not the request's fault: never a 400
    body = r.json()
    assert body["category"] == "server" and "internal error" in body["error"], body
    assert secret not in r.text and "AttributeError" not in r.text and "NoneType" not in r.text
    ref = body["error"].split("logged as ")[1].split(")")[0]
    logged = [rec for rec in caplog.records if ref in rec.getMessage()]
    assert logged and logged[0].exc_info is not None and logged[0].exc_info[0] is AttributeError
    http.close()


def test_a_fault_in_queued_work_is_a_server_future_without_its_insides(server, tenant_key, monkeypatch, caplog):
    http = _tinker(server, tenant_key)
    model_id = _tinker_model(http)
    backend = next(iter(server.runtime.engines.values())).backend
    secret = str(server.runtime.data_dir / "tenants")

    def broken(*args, **kwargs):
        raise RuntimeError(f"optimizer state under {secret} is corrupt")

    monkeypatch.setattr(backend, "optim_step", broken)
    with caplog.at_level(logging.ERROR, logger="twinkle.serve"):
        out = _tinker_result(http, http.post("/optim_step", json={"model_id": model_id, "adam_params": {}}))
    assert out["category"] == "server" and "internal error" in out["error"], out
    assert secret not in out["error"] and "corrupt" not in out["error"], out
    assert any(rec.exc_info and rec.exc_info[0] is RuntimeError for rec in caplog.records)
    http.close()
