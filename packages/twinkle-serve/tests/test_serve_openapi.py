"""The OpenAPI document a `/docs` reader gets: an `APIKeyHeader` scheme on every keyed route (so
"Authorize" then "Try it out" sends X-API-Key), none on the keyless probes, and typed bodies for the
Tinker JSON routes."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def spec(server):
    return httpx.get(f"{server.url}/openapi.json").json()


def test_the_api_key_header_is_a_security_scheme(spec):
    scheme = spec["components"]["securitySchemes"]["APIKeyHeader"]
    assert scheme == {**scheme, "type": "apiKey", "in": "header", "name": "X-API-Key"}
    keyed = {
        (m, p)
        for p, ops in spec["paths"].items()
        for m, op in ops.items()
        if {"APIKeyHeader": []} in op.get("security", [])
    }
    for route in [
        ("post", "/api/v1/create_model"),
        ("post", "/api/v1/retrieve_future"),
        ("get", "/api/v1/healthz"),
        ("post", "/twinkle/v1/models"),
        ("get", "/twinkle/v1/futures/{request_id}"),
        ("get", "/twinkle/v1/dashboard/summary"),
    ]:
        assert route in keyed, route
    assert ("get", "/livez") not in keyed and ("get", "/readyz") not in keyed


def test_a_key_sent_the_way_docs_sends_it_is_accepted(server, spec, keys):
    # what the "Try it out" button does once authorized: the scheme's header name with the key
    header = spec["components"]["securitySchemes"]["APIKeyHeader"]["name"]
    assert httpx.get(f"{server.url}/api/v1/healthz", headers={header: keys["alice"]}).status_code == 200


@pytest.mark.parametrize(
    "path, required, field",
    [
        ("/api/v1/create_model", {"session_id", "base_model"}, "lora_config"),
        ("/api/v1/optim_step", {"model_id"}, "adam_params"),
        ("/api/v1/save_weights", {"model_id"}, "ttl_seconds"),
        ("/api/v1/load_weights", {"path"}, "optimizer"),
        ("/api/v1/asample", {"sampling_session_id", "prompt"}, "sampling_params"),
        ("/api/v1/create_sampling_session", {"session_id"}, "model_path"),
        ("/api/v1/retrieve_future", {"request_id"}, "request_id"),
    ],
)
def test_tinker_json_routes_have_typed_bodies(spec, path, required, field):
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert set(schema.get("required", [])) == required and field in schema["properties"]


def test_nested_body_types_resolve(spec):
    schemas = spec["components"]["schemas"]
    lora = schemas["CreateModelBody"]["properties"]["lora_config"]["anyOf"][0]["$ref"]
    assert schemas[lora.rsplit("/", 1)[-1]]["properties"]["rank"]["default"] == 32
    assert "application/x-protobuf" in spec["paths"]["/api/v1/forward_backward"]["post"]["requestBody"]["content"]
