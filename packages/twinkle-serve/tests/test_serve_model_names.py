"""Base-model names through the unmodified tinker SDK: `<base>:peft:<context>` wherever a base model is
named, capabilities with each model's real context and caps, get_info's real architecture, and
SamplingClient.get_tokenizer() through the model's folder."""

from __future__ import annotations

import json
import shutil

import pytest

from twinkle.hub import TEST_MODEL, resolve_model_path

TENANT = "nomi"
SEQ = [5, 9, 13, 17, 21, 25, 29]


@pytest.fixture(scope="module")
def client(server, tenant_key):
    import tinker

    return tinker.ServiceClient(base_url=server.url, api_key=tenant_key)


def served_context() -> int:
    with open(resolve_model_path(TEST_MODEL) + "/config.json") as f:
        return json.load(f)["max_position_embeddings"]


def test_peft_suffix_is_accepted_for_training_and_sampling(client, sft):
    from tinker import types

    n = served_context()
    tc = client.create_lora_training_client(base_model=f"{TEST_MODEL}:peft:{n}", rank=4, seed=1).result()
    out = tc.forward_backward([sft(SEQ)], "cross_entropy").result()
    assert out.metrics["loss:sum"] > 0
    sampler = client.create_sampling_client(base_model=f"{TEST_MODEL}:peft:{n // 2}").result()
    seq = sampler.sample(types.ModelInput.from_ints(SEQ), 1, types.SamplingParams(max_tokens=3)).result()
    assert len(seq.sequences[0].tokens) == 3


def test_a_context_above_what_is_served_is_a_400_naming_the_max(client):
    import tinker

    n = served_context()
    with pytest.raises(tinker.BadRequestError, match=rf"context of {n + 1} tokens; .* serves at most {n} here"):
        client.create_lora_training_client(base_model=f"{TEST_MODEL}:peft:{n + 1}", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match=rf"serves at most {n}"):
        client.create_sampling_client(base_model=f"{TEST_MODEL}:peft:{10 * n}").result()
    with pytest.raises(tinker.BadRequestError, match="':peft:' suffix takes a context length in tokens, got 'lots'"):
        client.create_sampling_client(base_model=f"{TEST_MODEL}:peft:lots").result()


def test_capabilities_report_real_context_and_caps(server, tenant_key):
    import tinker

    rest = tinker.RestClient(base_url=server.url, api_key=tenant_key)
    models = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
    n = served_context()
    assert models[TEST_MODEL].max_context_length == n


def test_capabilities_json_carries_caps_and_arch(server, tenant_key):
    import httpx

    body = httpx.get(
        f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": tenant_key}, timeout=30
    ).json()
    row = next(m for m in body["supported_models"] if m["model_name"] == TEST_MODEL)
    assert row["arch"] == "qwen3" and row["max_topk_logprobs"] >= 20
    assert row["base_dtype"] == "fp32"  # 'auto' keeps a model this small in fp32 (twinkle.model.base_dtype)


LLAMA_ALIAS = "Org/Hub-Llama-70B"  # a hub id a script hard-codes, served by the tiny llama


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory, start):
    """A second server on a tiny llama (random weights, the test model's tokenizer), named by its folder."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(resolve_model_path(TEST_MODEL))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=1536,
    )
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    models = [{"name": str(folder), "path": str(folder), "aliases": [LLAMA_ALIAS]}]
    srv = start(tmp_path_factory.mktemp("llama-data"), models=models)
    yield srv, str(folder)
    srv.stop()
    shutil.rmtree(folder, ignore_errors=True)


def test_get_info_reports_the_config_architecture(llama_server):
    import tinker

    srv, folder = llama_server
    client = tinker.ServiceClient(base_url=srv.url, api_key=srv.create_key("lara"))
    tc = client.create_lora_training_client(base_model=folder, rank=4).result()
    assert tc.get_info().model_data.arch == "llama"
    rest = tinker.RestClient(base_url=srv.url, api_key=srv.create_key("lara2"))
    caps = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
    assert caps[folder].max_context_length == 1536


def test_sampling_client_get_tokenizer_through_the_model_folder(client):
    """SamplingClient.get_tokenizer() loads AutoTokenizer.from_pretrained(base_model.split(':')[0]): by the
    folder get_info names as tokenizer_id, accepted as the base model's name, it loads with no SDK patch."""
    from tinker import types

    tc = client.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2).result()
    folder = tc.get_info().model_data.tokenizer_id
    sampler = client.create_sampling_client(base_model=folder).result()
    tok = sampler.get_tokenizer()
    assert tok.encode("hello world") == tc.get_tokenizer().encode("hello world")
    out = sampler.sample(types.ModelInput.from_ints(tok.encode("hello")), 1, types.SamplingParams(max_tokens=2))
    assert len(out.result().sequences[0].tokens) == 2


def test_an_alias_names_the_same_engine_for_training_and_sampling(llama_server):
    """A config alias is accepted wherever a base model is named (with a :peft: suffix too); the run is
    recorded under the entry's name, the alias is listed in capabilities, and one engine serves both."""
    import tinker
    from tinker import types

    srv, folder = llama_server
    client = tinker.ServiceClient(base_url=srv.url, api_key=srv.create_key("ali"))
    tc = client.create_lora_training_client(base_model=f"{LLAMA_ALIAS}:peft:1536", rank=4, seed=3).result()
    assert tc.get_info().model_data.model_name == folder
    sampler = client.create_sampling_client(base_model=LLAMA_ALIAS).result()
    direct = client.create_sampling_client(base_model=folder).result()
    prompt, params = types.ModelInput.from_ints(SEQ), types.SamplingParams(max_tokens=3, seed=7)
    assert (
        sampler.sample(prompt, 1, params).result().sequences[0].tokens
        == direct.sample(prompt, 1, params).result().sequences[0].tokens
    )
    rest = tinker.RestClient(base_url=srv.url, api_key=srv.create_key("ali2"))
    caps = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
    assert caps[LLAMA_ALIAS].max_context_length == caps[folder].max_context_length == 1536
    with pytest.raises(tinker.BadRequestError, match="serves at most 1536"):
        client.create_sampling_client(base_model=f"{LLAMA_ALIAS}:peft:1537").result()


def test_a_name_given_twice_in_the_config_is_refused():
    from twinkle.serve.config import ServeConfig

    with pytest.raises(ValueError, match="model name 'a/b' is given twice"):
        ServeConfig.model_validate({"models": [{"name": "x", "aliases": ["a/b"]}, {"name": "a/b"}]})
