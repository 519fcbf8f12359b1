"""Isolation matrix and checkpoint-name safety against one real `twinkle-server` process.

For every route that takes an id (session, model, sampler, future, run, checkpoint), on both APIs
(Tinker /api/v1 and native /twinkle/v1; the dashboard's one JSON route takes none), tenant B
holding tenant A's id gets 404 (indistinguishable from absent); the same requests without a key get
401; a revoked key gets 401 on its very next request. The routes come from the server's own
/openapi.json: a route that is neither in the matrix nor listed here as id-free fails the test.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from _util_isolation import SEQ, NativeWire, native_row
from harness import SUMMARY, Wire, fb_body, revoke_key, sft_pair


@pytest.fixture(scope="module")
def world(launch):
    srv, keys = launch(["alice", "bob", "carol"])
    a = Wire(srv.url, keys["alice"])
    sid = a.session()
    mid = a.create_model(sid, seed=1)
    a.done(
        a.http.post(
            "/api/v1/forward_backward",
            content=fb_body(mid, 1, [sft_pair(SEQ)]),
            headers={"content-type": "application/x-protobuf"},
        )
    )
    ckpt = a.done(a.post("/save_weights", {"model_id": mid, "path": "a1", "seq_id": 2}))["path"]
    sampler_ckpt = a.done(a.post("/save_weights_for_sampler", {"model_id": mid, "path": "s1", "seq_id": 3}))["path"]
    sampler = a.ok(
        a.post(
            "/create_sampling_session", {"session_id": sid, "model_path": sampler_ckpt, "sampling_session_seq_id": 0}
        )
    )["sampling_session_id"]
    future = a.ok(a.post("/optim_step", {"model_id": mid, "seq_id": 4, "adam_params": {"learning_rate": 1e-3}}))
    a.result(future["request_id"])
    # the same objects made through the native API
    n = NativeWire(srv.url, keys["alice"])
    nmid = n.model(seed=1)
    n.done(n.add_adapter(nmid))
    nfuture = n.ok(n.post(f"/models/{nmid}/forward_backward", {"inputs": {"rows": [native_row()]}}))["request_id"]
    assert n.wait(nfuture)["status"] == "complete"
    nckpt = n.done(n.post(f"/models/{nmid}/save", {"name": "n1"}))["path"]
    ids = dict(
        session=sid,
        model=mid,
        ckpt=ckpt,
        sampler_ckpt=sampler_ckpt,
        sampler=sampler,
        future=future["request_id"],
        native_model=nmid,
        native_future=nfuture,
        native_ckpt=nckpt,
    )
    yield srv, keys, ids
    a.close()
    n.close()


# Routes that take no id of a tenant object (each still needs a key unless PUBLIC): why, per route.
ID_FREE = {
    ("POST", "/api/v1/client/config"): "SDK bootstrap",
    ("POST", "/api/v1/client/dynamic_config"): "SDK bootstrap",
    ("GET", "/api/v1/healthz"): "liveness",
    ("GET", "/api/v1/get_server_capabilities"): "base models",
    ("POST", "/api/v1/create_session"): "creates; takes no id",
    ("POST", "/api/v1/telemetry"): "accepted and dropped",
    ("GET", "/api/v1/sessions"): "the caller's own list",
    ("GET", "/api/v1/training_runs"): "the caller's own list",
    ("GET", "/api/v1/checkpoints"): "the caller's own list",
    ("POST", "/twinkle/v1/models"): "creates; takes a base model name only",
    ("POST", "/twinkle/v1/adapters/import"): "creates; takes a base model name and the files only",
    ("GET", "/twinkle/v1/runs"): "the caller's own list",
    ("GET", "/twinkle/v1/server"): "capacity and queue",
    ("GET", "/twinkle/v1/capacity"): "adapters that fit, per tier (server-wide counts, no tenant's data)",
    ("GET", "/twinkle/v1/result_types"): "schema examples",
    ("GET", "/twinkle/v1/dashboard/summary"): "the caller's own runs",
    ("GET", "/twinkle/v1/operator/summary"): "server-wide load for operator keys (a tenant key: 403)",
    ("POST", "/api/v1/sessions/search"): "searches the caller's own sessions only",
    ("GET", "/api/v1/auth/apikey/me"): "the caller's own key",
    ("DELETE", "/api/v1/auth/apikey/me"): "revokes the caller's own key",
    ("GET", "/api/v1/billing/usage/events"): "the caller's own usage",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "the caller's own storage",
    ("GET", "/api/v1/audit"): "the caller's own audit log",
    ("GET", "/api/v1/checkpoint_files/{token}"): "a signed URL: the token is the credential (bad token: 403)",
    ("GET", "/api/v1/session_traces/{token}"): "a signed URL: the token is the credential (bad token: 403)",
}
PUBLIC = {
    ("GET", "/twinkle/v1/result_types"),  # static schema examples: no tenant data, no key needed
    ("GET", "/api/v1/checkpoint_files/{token}"),
    ("GET", "/api/v1/session_traces/{token}"),
}
ID_WORDS = ("id", "path", "checkpoint", "sampler", "session", "run", "request")
# Id-named body fields of id-free routes that only filter the caller's own objects: another tenant's id
# matches nothing (an empty page, not 404); test_isolation_matrix checks that answer.
OWN_FILTERS = {("POST", "/api/v1/sessions/search"): {"session_id", "project_ids"}}


def id_requests(ids: dict, own_session: str, own_native: str):
    """(label, method, route template, concrete path, kwargs) for every id-taking route, aimed at A's objects."""
    from twinkle.hub import TEST_MODEL as base

    mid, run_ckpt, nmid = ids["model"], "weights/a1", ids["native_model"]
    fb = fb_body(mid, 9, [sft_pair(SEQ)])
    proto = {"content": fb, "headers": {"content-type": "application/x-protobuf"}}
    rows = {"json": {"inputs": {"rows": [native_row()]}}}
    run_t, ckpt_t = "/api/v1/training_runs/{run_id}", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"
    model_t = "/twinkle/v1/models/{model_id}"
    cases = [
        ("session get", "GET", "/api/v1/sessions/{session_id}", f"/api/v1/sessions/{ids['session']}", {}),
        ("session heartbeat", "POST", "/api/v1/session_heartbeat", None, {"json": {"session_id": ids["session"]}}),
        (
            "session finish",
            "POST",
            "/api/v1/sessions/{session_id}/finish",
            f"/api/v1/sessions/{ids['session']}/finish",
            {"json": {}},
        ),
        (
            "create_model in A's session",
            "POST",
            "/api/v1/create_model",
            None,
            # a whole body, as the SDK sends it: the answer must come from whose session it is, not its shape
            {"json": {"session_id": ids["session"], "model_seq_id": 7, "base_model": base, "lora_config": {"rank": 4}}},
        ),
        ("model get_info", "POST", "/api/v1/get_info", None, {"json": {"model_id": mid}}),
        ("model forward_backward", "POST", "/api/v1/forward_backward", None, proto),
        ("model optim_step", "POST", "/api/v1/optim_step", None, {"json": {"model_id": mid, "adam_params": {}}}),
        ("model save_weights", "POST", "/api/v1/save_weights", None, {"json": {"model_id": mid, "path": "stolen"}}),
        (
            "model save_weights_for_sampler",
            "POST",
            "/api/v1/save_weights_for_sampler",
            None,
            {"json": {"model_id": mid, "path": "stolen"}},
        ),
        (
            "checkpoint load_weights",
            "POST",
            "/api/v1/load_weights",
            None,
            {"json": {"session_id": own_session, "model_seq_id": 8, "path": ids["ckpt"], "optimizer": True}},
        ),
        (
            "sampler in A's session",
            "POST",
            "/api/v1/create_sampling_session",
            None,
            {"json": {"session_id": ids["session"]}},
        ),
        (
            "sampler from A's checkpoint",
            "POST",
            "/api/v1/create_sampling_session",
            None,
            {"json": {"session_id": own_session, "model_path": ids["sampler_ckpt"], "sampling_session_seq_id": 5}},
        ),
        ("sampler get", "GET", "/api/v1/samplers/{sampler_id}", f"/api/v1/samplers/{ids['sampler']}", {}),
        (
            "sampler asample",
            "POST",
            "/api/v1/asample",
            None,
            {
                "json": {
                    "sampling_session_id": ids["sampler"],
                    "prompt": {"chunks": [{"tokens": [1, 2]}]},
                    "num_samples": 1,
                    "sampling_params": {"max_tokens": 2},
                }
            },
        ),
        (
            "import an adapter into A's session",
            "POST",
            "/api/v1/import_adapter",
            None,
            {"json": {"session_id": ids["session"], "base_model": base, "name": "stolen", "files": {}}},
        ),
        ("future retrieve", "POST", "/api/v1/retrieve_future", None, {"json": {"request_id": ids["future"]}}),
        (
            "native future via Tinker retrieve",
            "POST",
            "/api/v1/retrieve_future",
            None,
            {"json": {"request_id": ids["native_future"]}},
        ),
        ("run get", "GET", run_t, f"/api/v1/training_runs/{mid}", {}),
        ("run checkpoints", "GET", run_t + "/checkpoints", f"/api/v1/training_runs/{mid}/checkpoints", {}),
        ("checkpoint delete", "DELETE", ckpt_t, f"/api/v1/training_runs/{mid}/checkpoints/{run_ckpt}", {}),
        (
            "checkpoint publish",
            "POST",
            ckpt_t + "/publish",
            f"/api/v1/training_runs/{mid}/checkpoints/{run_ckpt}/publish",
            {},
        ),
        (
            "checkpoint unpublish",
            "DELETE",
            ckpt_t + "/publish",
            f"/api/v1/training_runs/{mid}/checkpoints/{run_ckpt}/publish",
            {},
        ),
        (
            "checkpoint ttl",
            "PUT",
            ckpt_t + "/ttl",
            f"/api/v1/training_runs/{mid}/checkpoints/{run_ckpt}/ttl",
            {"json": {"ttl_seconds": 1}},
        ),
        ("checkpoint weights_info", "POST", "/api/v1/weights_info", None, {"json": {"tinker_path": ids["ckpt"]}}),
        (
            "custom loss in A's session",
            "POST",
            "/api/v1/create_custom_loss",
            None,
            {
                "json": {
                    "session_id": ids["session"],
                    "custom_loss_seq_id": 0,
                    "name": "l",
                    "inputs": [{"name": "logprobs", "rank": 1}],
                    "graph": {"nodes": []},
                }
            },
        ),
        (
            "completions of A's sampler",
            "POST",
            "/api/v1/retrieve_futures",
            None,
            {"json": {"target": {"sampling_session_id": ids["sampler"]}, "timeout": 0}},
        ),
        ("cancel A's future", "POST", "/api/v1/cancel_future", None, {"json": {"request_id": ids["future"]}}),
        (
            "join A's sampler",
            "POST",
            "/api/v1/join_sampling_session",
            None,
            {"json": {"sampling_session_id": ids["sampler"]}},
        ),
        (
            "model save_weights_external",
            "POST",
            "/api/v1/save_weights_external",
            None,
            {"json": {"model_id": mid, "path": "stolen"}},
        ),
        (
            "checkpoint external_weights_urls",
            "GET",
            ckpt_t + "/external_weights_urls",
            f"/api/v1/training_runs/{mid}/checkpoints/{run_ckpt}/external_weights_urls",
            {},
        ),
        (
            "copy A's checkpoint",
            "POST",
            "/api/v1/copy_weights",
            None,
            {"json": {"source_path": ids["ckpt"], "destination_project_id": "p"}},
        ),
        (
            "session project",
            "PUT",
            "/api/v1/sessions/{session_id}/project",
            f"/api/v1/sessions/{ids['session']}/project",
            {"json": {"project_id": "p"}},
        ),
        (
            "session trace_export",
            "GET",
            "/api/v1/sessions/{session_id}/trace_export",
            f"/api/v1/sessions/{ids['session']}/trace_export",
            {},
        ),
        # ---- native API ----
        ("native model close", "DELETE", model_t, f"/twinkle/v1/models/{nmid}", {}),
        (
            "native add_adapter",
            "POST",
            model_t + "/add_adapter_to_model",
            f"/twinkle/v1/models/{nmid}/add_adapter_to_model",
            {"json": {"adapter_name": "b"}},
        ),
        *[
            (
                f"native {what}",
                "POST",
                f"{model_t}/{what}",
                f"/twinkle/v1/models/{nmid}/{what}",
                {"json": {"name": name}},
            )
            for what, name in (
                ("set_loss", "CrossEntropyLoss"),
                ("set_optimizer", "AdamW"),
                ("set_lr_scheduler", "LinearLR"),
                ("add_metric", "LossMetric"),
            )
        ],
        *[
            (f"native {what}", "POST", f"{model_t}/{what}", f"/twinkle/v1/models/{nmid}/{what}", rows)
            for what in ("forward_backward", "forward_only", "forward")
        ],
        (
            "native clip_grad_and_step",
            "POST",
            model_t + "/clip_grad_and_step",
            f"/twinkle/v1/models/{nmid}/clip_grad_and_step",
            {"json": {}},
        ),
        (
            "native calculate_metric",
            "POST",
            model_t + "/calculate_metric",
            f"/twinkle/v1/models/{nmid}/calculate_metric",
            {"json": {}},
        ),
        ("native save", "POST", model_t + "/save", f"/twinkle/v1/models/{nmid}/save", {"json": {"name": "stolen"}}),
        (
            "native load into A's model",
            "POST",
            model_t + "/load",
            f"/twinkle/v1/models/{nmid}/load",
            {"json": {"path": ids["native_ckpt"]}},
        ),
        (
            "native load A's checkpoint into own model",
            "POST",
            model_t + "/load",
            f"/twinkle/v1/models/{own_native}/load",
            {"json": {"path": ids["native_ckpt"], "adapter_name": "stolen"}},
        ),
        (
            "native resume A's checkpoint into own model",
            "POST",
            model_t + "/resume_from_checkpoint",
            f"/twinkle/v1/models/{own_native}/resume_from_checkpoint",
            {"json": {"path": ids["ckpt"]}},
        ),
        ("native log", "POST", model_t + "/log", f"/twinkle/v1/models/{nmid}/log", {"json": {"metrics": {"r": 1.0}}}),
        (
            "native sample A's model",
            "POST",
            "/twinkle/v1/sample",
            None,
            {"json": {"model_id": nmid, "prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}},
        ),
        (
            "native sample A's checkpoint",
            "POST",
            "/twinkle/v1/sample",
            None,
            {"json": {"checkpoint": ids["native_ckpt"], "prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}},
        ),
        (
            "native sample A's Tinker checkpoint",
            "POST",
            "/twinkle/v1/sample",
            None,
            {"json": {"checkpoint": ids["sampler_ckpt"], "prompts": [[1, 2]], "sampling_params": {"max_tokens": 2}}},
        ),
        (
            "native future",
            "GET",
            "/twinkle/v1/futures/{request_id}",
            f"/twinkle/v1/futures/{ids['native_future']}",
            {"params": {"timeout": 0}},
        ),
        (
            "native cancel A's future",
            "POST",
            "/twinkle/v1/futures/{request_id}/cancel",
            f"/twinkle/v1/futures/{ids['native_future']}/cancel",
            {},
        ),
        (
            "Tinker future via native",
            "GET",
            "/twinkle/v1/futures/{request_id}",
            f"/twinkle/v1/futures/{ids['future']}",
            {"params": {"timeout": 0}},
        ),
        ("native run curves", "GET", "/twinkle/v1/runs/{model_id}/curves", f"/twinkle/v1/runs/{nmid}/curves", {}),
        (
            "Tinker run curves via native",
            "GET",
            "/twinkle/v1/runs/{model_id}/curves",
            f"/twinkle/v1/runs/{mid}/curves",
            {},
        ),
        ("dashboard run page", "GET", "/twinkle/v1/dashboard/runs/{model_id}", f"/twinkle/v1/dashboard/runs/{mid}", {}),
        (
            "dashboard samples of A's run",
            "GET",
            "/twinkle/v1/dashboard/runs/{model_id}/samples",
            f"/twinkle/v1/dashboard/runs/{nmid}/samples",
            {},
        ),
        (
            "dashboard samples posted to A's run",
            "POST",
            "/twinkle/v1/dashboard/runs/{model_id}/samples",
            f"/twinkle/v1/dashboard/runs/{mid}/samples",
            {"json": {"samples": [{"prompt": "p", "completion": "c"}]}},
        ),
        ("native checkpoints of A's run", "GET", "/twinkle/v1/checkpoints", None, {"params": {"model_id": nmid}}),
        (
            "native archive of A's checkpoint",
            "GET",
            "/twinkle/v1/checkpoints/archive",
            None,
            {"params": {"path": ids["native_ckpt"]}},
        ),
        (
            "native archive of A's Tinker checkpoint",
            "GET",
            "/twinkle/v1/checkpoints/archive",
            None,
            {"params": {"path": ids["ckpt"]}},
        ),
    ]
    return [(label, method, template, path or template, kw) for label, method, template, path, kw in cases]


def served_routes(url: str) -> dict[tuple[str, str], dict]:
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    return {
        (method.upper(), path): op
        for path, ops in spec["paths"].items()
        for method, op in ops.items()
        if path.startswith(("/api/", "/twinkle/"))
    }


def _names_an_id(op: dict, spec_schemas: dict) -> list[str]:
    """Path/query parameters or declared body fields of an operation that look like an object's id."""
    names = [p["name"] for p in op.get("parameters", []) if p["in"] in ("path", "query")]
    ref = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
    if ref:
        names += list(spec_schemas.get(ref.rsplit("/", 1)[-1], {}).get("properties", {}))
    return [n for n in names if n != "base_model" and any(w in n.lower() for w in ID_WORDS)]


def test_every_route_is_in_the_matrix_or_id_free(world):
    srv, _, ids = world
    routes = served_routes(srv.url)
    schemas = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()["components"]["schemas"]
    covered = {(m, t) for _, m, t, _, _ in id_requests(ids, "s", "m")}
    unclassified = sorted(set(routes) - covered - set(ID_FREE))
    assert not unclassified, f"routes with no isolation-matrix case and not listed as id-free: {unclassified}"
    stale = sorted((covered | set(ID_FREE)) - set(routes))
    assert not stale, f"matrix cases for routes the server does not serve: {stale}"
    id_like = {r: sorted(set(_names_an_id(routes[r], schemas)) - OWN_FILTERS.get(r, set())) for r in ID_FREE}
    assert not any(id_like.values()), {r: v for r, v in id_like.items() if v}


def test_isolation_matrix(world):
    srv, keys, ids = world
    bob, anon = Wire(srv.url, keys["bob"]), Wire(srv.url, None)
    bob_native = NativeWire(srv.url, keys["bob"])
    own_native = bob_native.model(seed=2)
    bob_native.done(bob_native.add_adapter(own_native))
    requests = id_requests(ids, bob.session(), own_native)
    wrong = {}
    for label, method, _, path, kw in requests:
        r = bob.http.request(method, path, **kw)
        if r.status_code != 404:
            wrong[f"B: {label}"] = (r.status_code, r.text[:200])
        r = anon.http.request(method, path, **kw)
        if r.status_code != 401:
            wrong[f"no key: {label}"] = (r.status_code, r.text[:200])
    id_free = [(m, p) for m, p in ID_FREE if (m, p) not in PUBLIC]
    for method, path in id_free:
        r = anon.http.request(method, path, **({"json": {}} if method == "POST" else {}))
        if r.status_code != 401:
            wrong[f"no key: {method} {path}"] = (r.status_code, r.text[:200])
    assert not wrong, wrong
    # a search filtered by A's session id finds it for A and nothing for B
    found = {
        k: w.ok(w.post("/sessions/search", {"session_id": ids["session"]}))["sessions"]
        for k, w in (("bob", bob), ("alice", Wire(srv.url, keys["alice"])))
    }
    assert found["bob"] == [] and [s["session_id"] for s in found["alice"]] == [ids["session"]], found
    # B's listings show none of A's objects, and A's objects are untouched by B's attempts
    assert ids["model"] not in bob.get("/training_runs").text and ids["ckpt"] not in bob.get("/checkpoints").text
    assert ids["native_model"] not in bob_native.get("/runs").text
    assert ids["native_ckpt"] not in bob_native.get("/checkpoints").text
    assert ids["native_model"] not in bob_native.get("/dashboard/summary").text
    alice, alice_native = Wire(srv.url, keys["alice"]), NativeWire(srv.url, keys["alice"])
    listed = alice.ok(alice.get(f"/training_runs/{ids['model']}/checkpoints"))["checkpoints"]
    assert {c["tinker_path"] for c in listed} == {ids["ckpt"], ids["sampler_ckpt"]}
    assert not any(c["public"] or c["expires_at"] for c in listed)
    still = alice_native.ok(
        alice_native.post(f"/models/{ids['native_model']}/forward_only", {"inputs": {"rows": [native_row()]}})
    )  # B's close did not free it
    assert alice_native.wait(still["request_id"])["status"] == "complete"
    assert [
        c["path"]
        for c in alice_native.ok(alice_native.get("/checkpoints", params={"model_id": ids["native_model"]}))[
            "checkpoints"
        ]
    ] == [ids["native_ckpt"]]
    # a revoked key is refused on its next request (no caching of key -> tenant), on both APIs
    carol, carol_native = Wire(srv.url, keys["carol"]), NativeWire(srv.url, keys["carol"])
    assert carol.get("/training_runs").status_code == 200 and carol_native.get("/runs").status_code == 200
    revoke_key(srv.data_dir, "carol")
    revoked = [
        carol.get("/training_runs").status_code,
        carol.post("/create_session", {}).status_code,
        carol_native.get("/runs").status_code,
        carol_native.post("/models", {}).status_code,
    ]
    assert revoked == [401] * 4, revoked
    n = 2 * len(requests) + len(id_free) + len(revoked)
    routes = len({(m, t) for _, m, t, _, _ in requests})
    print(
        f"\nisolation: {len(requests)} cases over {routes} id-taking routes (both APIs) x (other tenant -> 404, "
        f"no key -> 401) + {len(id_free)} id-free routes without a key -> 401 + revoked key -> 401 x "
        f"{len(revoked)}: {n} cases denied"
    )
    SUMMARY["isolation cases denied"] = (
        f"{n} ({len(requests)} id cases on {routes} routes of both APIs x other-tenant "
        f"404 / no-key 401, {len(id_free)} id-free no-key 401, "
        f"{len(revoked)} revoked-key 401)"
    )


@pytest.mark.parametrize("name", ["..", "../../escape", "/etc/passwd", "a/../../b", "a\x00b", "..\\x", "."])
def test_checkpoint_names_cannot_escape_the_tenant_dir(world, name):
    srv, keys, ids = world
    a = Wire(srv.url, keys["alice"])
    for route in ("/save_weights", "/save_weights_for_sampler"):
        r = a.post(route, {"model_id": ids["model"], "path": name})
        assert r.status_code == 400 and "checkpoint name" in r.json()["error"], (route, name, r.status_code, r.text)
    outside = [p for p in srv.data_dir.rglob("*") if "escape" in p.name or p.name == "b"]
    assert not outside, outside


def test_keys_are_stored_hashed(world):
    srv, keys, _ = world
    import hashlib

    db = sqlite3.connect(srv.data_dir / "twinkle.db")
    rows = dict(db.execute("SELECT name, key_hash FROM api_keys").fetchall())
    db.close()
    raw = b"".join(p.read_bytes() for p in srv.data_dir.glob("twinkle.db*"))
    for name, key in keys.items():
        assert rows[name] == hashlib.sha256(key.encode()).hexdigest()
        assert key.encode() not in raw and key[4:].encode() not in raw
